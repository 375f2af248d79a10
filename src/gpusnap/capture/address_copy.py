"""Copies by address for the copier's snapshot loop: no tensor, torch call or torch event per piece.

A fast-tier save copies a device's snapshot buffer into slab memory one piece at a time
(one copy in flight: ``capture/copier.py``), ~350 pieces for 11.4 GB. Through torch each
piece was two tensor slices, a ``copy_`` and a ``torch.cuda.Event``: ~60 us of Python under
the interpreter lock per piece, ~20 ms a save taken from a training thread that launches
all the time (sampled with ``py-spy --gil``, BENCHMARKS.md). Here a piece is
one driver call that queues the copy and one that records an event, both made through
``ctypes``, which lets the lock go for the length of each call; waiting on the event lets
it go too.

:func:`address_copies` returns the engine for a device: :class:`DriverCopies` on CUDA
(``cuMemcpyDtoHAsync`` on the copy stream, blocking-sync events), :class:`HostCopies` on
the CPU (``memmove``, done at once), or None where the driver lacks a function (the copier
then copies through torch, as before; the save's ``stats["copy_path"]`` says which ran). Addresses are the caller's promise: the source lies
in a live device buffer, the destination in page-locked host memory of at least ``n`` bytes
that outlives the copy.

>>> import torch
>>> src, dst = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
>>> engine = address_copies(src.device, None)
>>> engine.copy(dst.data_ptr(), src.data_ptr(), 8) is None, dst.tolist()
(True, [0, 1, 2, 3, 4, 5, 6, 7])
"""

from __future__ import annotations

import ctypes
import functools
import threading
import weakref
from typing import Any

import torch

from gpusnap.device import libcuda

__all__ = ["DriverCopies", "DriverEvent", "HostCopies", "address_copies"]

_BLOCKING_SYNC, _DISABLE_TIMING = 0x1, 0x2  # CU_EVENT_* flags
_NOT_READY = 600  # CUDA_ERROR_NOT_READY
_primary_lock = threading.Lock()
# per driver library (the process has one; a test's fake driver has its own): device index ->
# its retained primary context, kept for the library's lifetime
_primary: weakref.WeakKeyDictionary[Any, dict[int, int]] = weakref.WeakKeyDictionary()

ENABLED = True  # False: the copier copies through torch (an A/B switch for the probes)


class HostCopies:
    """CPU snapshots: each copy is a ``memmove``, complete when it returns."""

    def copy(self, dst: int, src: int, n: int) -> None:
        ctypes.memmove(dst, src, n)

    def restore_context(self) -> None:
        pass

    def close(self) -> None:
        pass


class DriverEvent:
    """A recorded driver event, waited on like a ``torch.cuda.Event`` (``query``, ``synchronize``)."""

    __slots__ = ("_engine", "handle")

    def __init__(self, engine: DriverCopies, handle: int) -> None:
        self._engine, self.handle = engine, handle

    def query(self) -> bool:
        if not self.handle:  # (completed, its handle given back)
            return True
        rc = self._engine.lib.cuEventQuery(ctypes.c_void_p(self.handle))
        if rc == _NOT_READY:
            return False
        _check(self._engine.lib, rc, "cuEventQuery")
        self._engine.recycle(self)
        return True

    def synchronize(self) -> None:
        if self.handle:
            _check(self._engine.lib, self._engine.lib.cuEventSynchronize(ctypes.c_void_p(self.handle)),
                   "cuEventSynchronize")
            self._engine.recycle(self)


class DriverCopies:
    """Device-to-host copies on one stream of one CUDA device, by address.

    Made per save on the copier thread: its events are its own (a stream may be shared by two
    Checkpointers' copiers), created as needed (one per copy in flight, reused once waited
    on) and destroyed by :meth:`close`."""

    def __init__(self, lib: ctypes.CDLL, device: torch.device, stream: Any) -> None:
        self.lib = lib
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.stream = ctypes.c_void_p(stream.cuda_stream)
        self._free: list[int] = []
        self._made: list[int] = []
        self._context = _primary_context(lib, self.device_index)
        self._previous: int | None = None  # the thread's context before make_current, if another
        self.make_current()

    def make_current(self) -> None:
        """This thread's current context is the device's primary one (torch's), as the driver
        calls need; the runtime may not have made it current on this thread yet."""
        current = ctypes.c_void_p()
        _check(self.lib, self.lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value != self._context:
            _check(self.lib, self.lib.cuCtxSetCurrent(ctypes.c_void_p(self._context)), "cuCtxSetCurrent")
            self._previous = current.value

    def restore_context(self) -> None:
        """The thread's context as :meth:`make_current` found it (its copies are all queued;
        waiting on their events needs no current context)."""
        previous, self._previous = self._previous, None
        if previous:
            _check(self.lib, self.lib.cuCtxSetCurrent(ctypes.c_void_p(previous)), "cuCtxSetCurrent")

    def copy(self, dst: int, src: int, n: int) -> DriverEvent:
        lib = self.lib
        handle = self._free.pop() if self._free else self._new_event()  # (before the copy: none queued untracked)
        try:
            _check(lib, lib.cuMemcpyDtoHAsync_v2(ctypes.c_void_p(dst), ctypes.c_uint64(src), ctypes.c_size_t(n),
                                                 self.stream), "cuMemcpyDtoHAsync")
        except BaseException:
            self._free.append(handle)
            raise
        rc = lib.cuEventRecord(ctypes.c_void_p(handle), self.stream)
        if rc != 0:  # the copy is queued but cannot be waited for: let it finish before the
            lib.cuStreamSynchronize(self.stream)  # caller hands its region back
            self._free.append(handle)
            _check(lib, rc, "cuEventRecord")
        return DriverEvent(self, handle)

    def recycle(self, event: DriverEvent) -> None:
        """``event`` has completed: its handle may be recorded again, and the event reads as
        complete from now on (a later wait on it must not see the handle's next recording)."""
        self._free.append(event.handle)
        event.handle = 0

    def close(self) -> None:
        """Destroy the events (an event still pending is freed by the driver once complete)."""
        made, self._made, self._free = self._made, [], []
        for handle in made:
            self.lib.cuEventDestroy_v2(ctypes.c_void_p(handle))

    def _new_event(self) -> int:
        handle = ctypes.c_void_p()
        _check(self.lib, self.lib.cuEventCreate(ctypes.byref(handle), _BLOCKING_SYNC | _DISABLE_TIMING), "cuEventCreate")
        assert handle.value is not None
        self._made.append(handle.value)
        return handle.value


def address_copies(device: torch.device, stream: Any) -> HostCopies | DriverCopies | None:
    """The copy engine for snapshots on ``device`` (``stream``: its copy stream, CUDA only), or
    None: copy through torch (switched off, another device type, or a driver without these
    functions)."""
    if not ENABLED:
        return None
    if device.type == "cpu":
        return HostCopies()
    if device.type != "cuda" or stream is None:
        return None
    lib = _driver()
    if lib is None:
        return None
    return DriverCopies(lib, device, stream)


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        lib = libcuda()
        for name in ("cuMemcpyDtoHAsync_v2", "cuEventCreate", "cuEventRecord", "cuEventQuery",
                     "cuEventSynchronize", "cuEventDestroy_v2", "cuStreamSynchronize", "cuCtxGetCurrent", "cuCtxSetCurrent",
                     "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuGetErrorName"):
            getattr(lib, name)
    except (OSError, AttributeError):
        return None
    lib.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    return lib


def _primary_context(lib: ctypes.CDLL, index: int) -> int:
    """The device's primary context (torch's own), retained once per process and driver library."""
    with _primary_lock:
        retained = _primary.setdefault(lib, {})
        if index not in retained:
            device, context = ctypes.c_int(), ctypes.c_void_p()
            _check(lib, lib.cuDeviceGet(ctypes.byref(device), index), "cuDeviceGet")
            _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
            assert context.value is not None
            retained[index] = context.value
        return retained[index]


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {(name.value or b'?').decode()} ({rc})")
