"""Load the device check's hash kernels on a side thread while a restore sets up.

A fresh process's first device-checked restore paid ~0.6 s in its first hash launches
(Triton loading the kernels and their launchers, with its on-disk cache warm or not), on the
copy thread, after ~0.45 s of set-up that does not need them: the host regions, the reader
processes, the loader (GPT-2 large on the H200: 1.24-1.29 s against 0.12 s warm;
BENCHMARKS.md, twelfth session). Started before that set-up and joined before the copy
thread starts, the loading overlaps it; the copy thread never races it for a first compile.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from gpusnap import launch_hooks
from gpusnap.kernels.chunk_hash import HASH_WORDS, chunk_hashes
from gpusnap.kernels.chunk_hash_many import chunk_hashes_many

__all__ = ["WARM_KERNELS", "start_kernel_warmup"]

WARM_KERNELS = True  # (a module switch: benchmarks compare with and without)


def start_kernel_warmup(devices: Iterable[torch.device], chunk_size: int) -> threading.Thread | None:
    """A started daemon thread that runs both hash paths of ``DeviceCheck.stage`` once per
    CUDA device (one span; a batch of two) on ``chunk_size``-byte chunks, on a stream of its
    own; None when there is nothing to warm. Join it before the copy thread starts. Failures
    are ignored here: the restore's own first check meets and reports them."""
    cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)
    if not WARM_KERNELS or not cuda:
        return None

    def run() -> None:
        for device in cuda:
            try:
                stream = torch.cuda.Stream(device)
                with torch.cuda.device(device), torch.cuda.stream(stream), launch_hooks.internal():
                    data = torch.zeros(2 * chunk_size, dtype=torch.uint8, device=device)
                    out = torch.empty((2, HASH_WORDS), dtype=torch.int64, device=device)
                    chunk_hashes(data, chunk_size, out=out)
                    chunk_hashes_many([data[:chunk_size], data[chunk_size:]], chunk_size, out)
                stream.synchronize()
            except Exception:  # noqa: BLE001 (a warm-up only)
                pass

    thread = threading.Thread(target=run, name="gpusnap-restore-warmup", daemon=True)
    thread.start()
    return thread
