"""Load the device check's hash kernels on a side thread while a restore sets up.

A fresh process's first device-checked restore paid ~0.5-1.3 s in its first hash launches
(Triton loading, or compiling, the kernels and their launchers), on the copy thread, after
~0.3 s of set-up that does not need them: the host regions, the reader processes, the
loader (GPT-2 large: 1.74 s against 0.92 s with this; BENCHMARKS.md). Started before that
set-up, the loading overlaps it; the copy thread waits for it before its first device check
(``Copier``), so it never races it for a first compile, while the readers start at once.

Each ``(device, chunk size)`` is warmed once per process: a warm process starts no thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from gpusnap import launch_hooks
from gpusnap.kernels.chunk_hash import HASH_WORDS, chunk_hashes
from gpusnap.kernels.chunk_hash_many import chunk_hashes_many

__all__ = ["WARM_KERNELS", "WarmUp", "start_kernel_warmup"]

WARM_KERNELS = True  # (a module switch: benchmarks compare with and without)
_warmed: set[tuple[torch.device, int]] = set()
_lock = threading.Lock()


class WarmUp:
    """A started warm-up: ``join()`` returns once the kernels are loaded (or failed to:
    ``error``; the restore's own first check then meets and reports the failure)."""

    def __init__(self, work: list[tuple[torch.device, Any]], chunk_size: int) -> None:
        self.error: BaseException | None = None
        self._work, self._chunk_size = work, chunk_size
        self.thread = threading.Thread(target=self._run, name="gpusnap-restore-warmup", daemon=True)
        self.thread.start()

    def join(self, timeout: float | None = None) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def _run(self) -> None:
        for device, stream in self._work:
            try:
                # On the restore's own copy stream: a stream from torch's pool could be one the
                # program is capturing a graph on. No sync: loading happens at launch, on the host.
                with torch.cuda.device(device), torch.cuda.stream(stream), launch_hooks.internal():
                    data = torch.zeros(2 * self._chunk_size, dtype=torch.uint8, device=device)
                    out = torch.empty((2, HASH_WORDS), dtype=torch.int64, device=device)
                    chunk_hashes(data, self._chunk_size, out=out)  # one piece (DeviceCheck.stage)
                    chunk_hashes_many([data[: self._chunk_size], data[self._chunk_size :]], self._chunk_size, out)
                with _lock:
                    _warmed.add((device, self._chunk_size))
            except BaseException as exc:  # noqa: BLE001 (kept for whoever asks; never raised here)
                self.error = exc


def start_kernel_warmup(
    devices: Iterable[torch.device], chunk_size: int, stream_of: Callable[[torch.device], Any]
) -> WarmUp | None:
    """Warm both hash paths of ``DeviceCheck.stage`` (one span; a batch of two) for each CUDA
    device of ``devices`` not yet warmed for ``chunk_size``-byte chunks, on ``stream_of(device)``;
    None when there is nothing to do."""
    with _lock:
        todo = sorted({d for d in devices if d.type == "cuda" and (d, chunk_size) not in _warmed}, key=str)
    if not WARM_KERNELS or not todo:
        return None
    return WarmUp([(d, stream_of(d)) for d in todo], chunk_size)
