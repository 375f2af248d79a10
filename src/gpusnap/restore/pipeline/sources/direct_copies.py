"""Direct copies for the restore: helper processes move pack bytes from the page cache straight
into landing slots on the device, with no copy through the host's CPU.

Why: a reader copies every byte from the page cache into a pinned region, then the copy
engine reads it again: two passes over host memory, which capped the restore near 25 GB/s
(45% of host-to-device; BENCHMARKS.md). A read-only map of a
pack page-locked *in place* (``cudaHostRegister``) lets the copy engine read the page cache
itself. One process page-locks at only 10-20 GB/s and its threads do not page-lock in
parallel, but separate processes do: 8 helpers moved a 4 GB file to the device at 48 GB/s.

Data flow, per batch of a device-checked span (``Loader``)::

    reader thread k:  landing slot (acquire) -> helper k (``direct_worker.py``): map the
                      packs, page-lock the runs' pages, copy each run into the slot over
                      CUDA IPC, wait, unlock -> the copy thread (``Copier``, ``landed``)
    copy thread:      hash the slot on the device (no H2D of its own) -> compare -> D2D
                      into the targets -> slot back after that copy's event

A helper that is still starting (CUDA takes ~0.1 s per process, one process after another)
is skipped: its reader thread stages the batch through host memory as before. A helper that
fails, dies or answers nonsense is killed and its thread falls back the same way.

>>> direct = DirectCopies(8, torch.device("cuda:0"), 32 << 20)      # doctest: +SKIP
>>> slot = direct.landing.acquire(); direct.copy(0, [(pack, 0, 4096, direct.landing.offset_of(slot))])  # doctest: +SKIP
[4096]
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import Any

import torch

from gpusnap.device import libcuda, loaded_cudart_path
from gpusnap.restore.pipeline.sources.reader_procs import WorkerProcs, runs_reply
from gpusnap.restore.pipeline.staging import SharedMemory, SlotPool

__all__ = ["DirectCopies", "DirectUnavailable"]

WORKER = str(Path(__file__).with_name("direct_worker.py"))
DEPTH = 2  # landing slots per helper: one being filled while the copy thread uses the other
# CUDA contexts start one process after another (~0.12 s each): a helper not
# ready by then never will be
START_TIMEOUT_S = 30.0


class DirectUnavailable(RuntimeError):
    """Direct copies cannot work here (no libcudart to hand the helpers, no IPC handle)."""


class DirectCopies:
    """``n`` helper processes copying into ``n * DEPTH`` landing slots of ``slot_bytes`` on
    ``device``. On a CPU device (tests) the landing buffer is shared memory and the helpers
    ``memmove``: the same protocol, slots and fallbacks, without CUDA.

    Readers: :meth:`ready` (k), ``landing.acquire()``, :meth:`copy` (k, runs); the copy
    thread: ``landing.release(slot)`` once no queued device work reads the slot.
    """

    def __init__(self, n: int, device: torch.device, slot_bytes: int, *, depth: int = DEPTH) -> None:
        self.device = device
        self.slot_bytes = slot_bytes
        nbytes = n * depth * slot_bytes
        self._shm: SharedMemory | None = None
        pass_fds: tuple[int, ...] = ()
        if device.type == "cuda":
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            lib = cudart_path()
            base, offset = _segment(self._buffer)
            job = {"backend": "cuda", "lib": lib, "device": device.index or 0, "handle": ipc_handle(lib, base).hex(),
                   "offset": offset}
        else:
            self._shm = SharedMemory(nbytes, pinned=False)
            self._buffer = self._shm.tensor
            job = {"backend": "memfd", "fd": self._shm.fd, "nbytes": nbytes}
            pass_fds = (self._shm.fd,)
        self.landing = SlotPool(n * depth, slot_bytes, pinned=False, backing=self._buffer)
        self._events: dict[int, list[Any]] = {}  # helper -> its interprocess events, opened here
        self.cuda_error: str | None = None  # a helper's copy failed in CUDA (a host that refuses read-only page-locking, say)
        self.procs = _DirectProcs(n, [WORKER], pass_fds=pass_fds, job=job, start_timeout=START_TIMEOUT_S)

    def __len__(self) -> int:
        return len(self.procs)

    def ready(self, k: int) -> bool:
        """Whether helper ``k`` can copy now (False while it starts); raises ReaderDied."""
        if k >= len(self.procs) or not self.procs.ready(k):
            return False
        if k not in self._events:
            hello = self.procs.hello[k]
            handles = hello[2] if isinstance(hello, tuple) and len(hello) == 3 else []
            if self.device.type == "cuda":
                try:
                    self._events[k] = [torch.cuda.Event.from_ipc_handle(self.device, bytes.fromhex(h)) for h in handles]
                except (RuntimeError, ValueError, TypeError) as exc:
                    self.procs._kill(self.procs._procs[k], f"sent events this process cannot open ({exc})")
            else:
                self._events[k] = []
        return True

    def copy(self, k: int, runs: list[tuple[str, int, int, int]]) -> tuple[list[int], Any]:
        """Have helper ``k`` (ready) copy ``runs`` ``(path, offset, length, landing offset)``:
        the bytes each run can get (all copied only when none is short), and the CUDA event
        the copies are done after (None: done already), for the copy stream to wait for.
        Raises ``OSError`` (a pack unreadable) or :class:`ReaderDied` (the helper is gone or broken)."""
        reply = self.procs.request(k, runs)
        if isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "cuda":
            self.cuda_error = str(reply[1])  # (the Restorer stops starting helpers: it would recur)
            self.procs._kill(self.procs._procs[k], f"failed: {reply[1]}")
        event: Any = None
        if isinstance(reply, tuple) and len(reply) == 3 and reply[0] == "ok":
            events, index = self._events.get(k, []), reply[2]
            if not isinstance(index, int) or not -1 <= index < len(events):
                self.procs._kill(self.procs._procs[k], f"answered event {index!r:.20}")
            event, reply = (events[index] if index >= 0 else None), reply[:2]
        return runs_reply(self.procs, k, reply, len(runs)), event

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> bool:
        """Wait until every helper is ready (benchmarks and tests; a restore never waits):
        whether they all are."""
        deadline = time.monotonic() + timeout
        while not all(self.ready(k) for k in range(len(self))):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def fits(self, device: torch.device, slot_bytes: int) -> bool:
        return device == self.device and slot_bytes == self.slot_bytes

    def alive(self) -> bool:
        return self.procs.alive()

    @property
    def start_failed(self) -> bool:
        return self.procs.start_failed

    def close(self) -> None:
        """End the helpers (they close their IPC mappings), then free the landing buffer."""
        self.procs.close()
        self._events.clear()
        del self.landing, self._buffer


class _DirectProcs(WorkerProcs):
    kind = "direct-copy"


def cudart_path() -> str:
    """The file of the libcudart this process's torch loaded (the helpers load the same)."""
    path = loaded_cudart_path()
    if path is None:
        raise DirectUnavailable("no libcudart is loaded in this process (torch links it statically?)")
    return path


def ipc_handle(lib_path: str, base: int) -> bytes:
    """``cudaIpcGetMemHandle`` of the allocation at ``base`` (64 bytes)."""
    lib = ctypes.CDLL(lib_path)
    handle = (ctypes.c_char * 64)()
    err = lib.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(base))
    if err:
        lib.cudaGetLastError()
        raise DirectUnavailable(f"cudaIpcGetMemHandle failed: CUDA error {err}")
    return bytes(handle)


def _segment(t: torch.Tensor) -> tuple[int, int]:
    """The base of the ``cudaMalloc`` allocation holding ``t`` (the caching allocator may
    have carved ``t`` out of a larger one), and ``t``'s offset in it."""
    try:
        cuda = libcuda()
    except OSError as exc:
        raise DirectUnavailable(f"libcuda.so.1: {exc}") from None
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    with torch.cuda.device(t.device):
        err = cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(t.data_ptr()))
    if err:
        raise DirectUnavailable(f"cuMemGetAddressRange failed: CUDA error {err}")
    return base.value, t.data_ptr() - base.value

