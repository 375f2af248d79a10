"""Load a save's kernels on a side thread when the Checkpointer is made, not in the first save().

The first ``save()`` of a process snapshotted Llama's 11.4 GB in 0.5-1.6 s instead of ~2 ms:
Triton loading (or compiling) the gather-copy kernel on the caller's thread, and
the chunk-hash kernel on the copier's. A Checkpointer made once CUDA is up starts this
instead. A save that comes while it still runs does not wait for it on the program's thread
(with an empty Triton cache that took a first save 2.9 s): its snapshot copies through torch
(:func:`loading`), and the copier waits for the kernels before it hashes (:func:`wait_loaded`).
Only a save that hashes at ``save()`` itself (spans it does not snapshot) waits there, for
what is left of it (``save_phases_s["open_window.kernels"]``).

Each ``(device, chunk size)`` is warmed once per process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from gpusnap import fork_safety, launch_hooks
from gpusnap.device import outside_graph_captures
from gpusnap.kernels.chunk_hash import HASH_WORDS, chunk_hashes
from gpusnap.kernels.chunk_hash_many import chunk_hashes_packed
from gpusnap.kernels.gather_copy import gather_copy, gather_copy_available

__all__ = ["WARMUP_JOIN_S", "CaptureWarmUp", "loading", "start_capture_warmup", "wait_loaded"]

_warmed: set[tuple[torch.device, int]] = set()
_running: dict[tuple[torch.device, int], CaptureWarmUp] = {}  # started, not finished
_lock = threading.Lock()


WARMUP_JOIN_S = 30.0  # close() waits at most this for a warm-up no save waited for


class CaptureWarmUp:
    """A warm-up (started by :func:`start_capture_warmup`); ``join()`` waits for it. Its failure is kept in ``error``, never
    raised: the save's own first launch then meets and reports it."""

    def __init__(self, device: torch.device, chunk_size: int, stream: Any) -> None:
        self.device, self.chunk_size, self.stream = device, chunk_size, stream
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="gpusnap-save-warmup", daemon=True)

    def join(self, timeout: float | None = None) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def _run(self) -> None:
        try:
            # a program capturing a CUDA graph meanwhile must not see this thread's calls; the
            # Checkpointer's own copy stream, never one from torch's pool that the program may
            # capture on; no synchronization: the kernels load at launch, on the host
            outside_graph_captures()
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream), launch_hooks.internal():
                src = torch.zeros(2 * self.chunk_size, dtype=torch.uint8, device=self.device)
                dst = torch.empty_like(src)
                if gather_copy_available(self.device):
                    gather_copy(dst, [0], [src.data_ptr()], [src.numel()])
                out = torch.empty((2, HASH_WORDS), dtype=torch.int64, device=self.device)
                chunk_hashes_packed(dst, [0], [dst.numel()], self.chunk_size, out=out)
                # the torch implementation too (spans a save hashes outside the Triton path): its
                # key table is built once per device, and its kernels load at first launch; in
                # the first save they took ~0.23 s of the copier's hashing
                chunk_hashes(dst[: self.chunk_size], self.chunk_size, impl="torch")
            with _lock:
                _warmed.add((self.device, self.chunk_size))
        except BaseException as exc:  # noqa: BLE001 (kept; the save's own launch reports it)
            self.error = exc
        finally:
            with _lock:
                if _running.get((self.device, self.chunk_size)) is self:
                    del _running[(self.device, self.chunk_size)]


def loading(device: torch.device) -> bool:
    """Whether a warm-up of ``device``'s save kernels is still running in this process: a
    launch of them now would load them on the launching thread meanwhile."""
    with _lock:
        return any(d == device for d, _chunk in _running)


def wait_loaded(devices: Iterable[torch.device], timeout: float = WARMUP_JOIN_S) -> float:
    """Wait (at most ``timeout`` s in all) for the running warm-ups of ``devices``; returns
    the seconds waited."""
    wanted = set(devices)
    with _lock:
        running = [w for (d, _chunk), w in _running.items() if d in wanted]
    if not running:
        return 0.0
    started = time.perf_counter()
    for warmup in running:
        warmup.join(max(0.0, timeout - (time.perf_counter() - started)))
    return time.perf_counter() - started


def start_capture_warmup(chunk_size: int, stream_of: Callable[[torch.device], Any]) -> CaptureWarmUp | None:
    """Warm the current CUDA device's save kernels on ``stream_of(device)`` (the copy stream,
    made here on the caller's thread), if CUDA is already initialized (a Checkpointer never
    initializes CUDA itself) and they are not warm; else None."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    with _lock:
        if (device, chunk_size) in _warmed:
            return None
        running = _running.get((device, chunk_size))
        if running is not None:  # (another Checkpointer's, still loading: waited for alike)
            return running
        warmup = _running[(device, chunk_size)] = CaptureWarmUp(device, chunk_size, stream_of(device))
        try:
            warmup.thread.start()  # (listed first: loading() sees it from now until it ends)
        except BaseException:  # (no thread: no entry, or loading() would stay true for good)
            del _running[(device, chunk_size)]
            raise
    return warmup


def _forget_in_child() -> None:
    """A forked child has none of the parent's warm-up threads, and a new lock."""
    global _lock, _running
    _lock = threading.Lock()
    _running = {}


fork_safety.at_fork(after_in_child=_forget_in_child)
