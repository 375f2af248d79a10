"""Host memory mapped from a file descriptor, optionally page-locked for CUDA copies.

Used where bytes must live in memory another process can see, without a host copy: the
restore's shared regions (a ``memfd``) and the fast tier's slab files, which the copy
engine writes straight into (``cudaHostRegister`` of the file's own pages).

The mapping belongs to a ctypes array that every tensor over it keeps alive
(``torch.frombuffer``): it is unlocked and unmapped only when the last of them is gone,
never under a live view.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import time
import weakref
from collections.abc import Callable

import torch

from gpusnap.device import clear_cuda_error

__all__ = ["MappedMemory", "in_steps"]

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels answer EINVAL


class MappedMemory:
    """``nbytes`` of ``fd`` (which this object then owns and closes) mapped shared and
    writable as ``tensor`` (uint8); page-locked when ``pinned``. ``populate`` faults every
    page in now (the kernel's work, without the GIL) rather than at the first copy, with
    ``madvise(MADV_POPULATE_WRITE)``: ``mmap(MAP_POPULATE)`` of a tmpfs file stopped a
    training thread for ~1 s per GiB, the madvise ~70 ms per GiB, and it reports memory it
    cannot allocate (a full tmpfs) as an ``OSError`` here instead of a SIGBUS at the first copy.

    ``step``: populate ``step`` bytes at a time, calling ``between(seconds the step took)``
    after each: one madvise of a GiB holds the process's memory map for its whole length,
    while 64 MiB steps with rests between them fit in the slack of the program's launch queue
    (``storage/slab_prep.py``). The page-locking stays one registration of the whole mapping:
    a copy over two adjacent registrations fails (``CUDA_ERROR_INVALID_VALUE``, measured on
    an H100), and a slab's copies may cross any 64 MiB boundary.

    Raises ``OSError`` (the map failed) or ``RuntimeError`` (page-locking failed; nothing
    stays mapped or locked); the caller then decides what to fall back to.
    """

    def __init__(self, fd: int, nbytes: int, *, pinned: bool, populate: bool = True, step: int | None = None,
                 between: Callable[[float], None] | None = None) -> None:
        self.nbytes = nbytes
        self.fd = fd
        addr = _LIBC.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"mmap of {nbytes} bytes failed: {os.strerror(err)}")
        self.address = addr
        memory = type("_Mapping", (ctypes.c_uint8 * nbytes,), {}).from_address(addr)
        state = {"pinned": False}
        weakref.finalize(memory, _unmap, addr, nbytes, fd, state)
        self.tensor = torch.frombuffer(memory, dtype=torch.uint8)  # keeps ``memory`` alive
        del memory
        self.pinned = False
        try:
            if populate:
                in_steps(nbytes, step, lambda lo, n: _populate(addr + lo, n), between)
            if pinned:
                _register(addr, nbytes)
                state["pinned"] = self.pinned = True
        except BaseException:
            del self.tensor  # (the last view: unmaps and closes fd)
            raise


def in_steps(nbytes: int, step: int | None, do: Callable[[int, int], None],
             between: Callable[[float], None] | None = None) -> None:
    """``do(offset, length)`` over ``nbytes`` in pieces of at most ``step`` (None: one piece),
    calling ``between(seconds the piece took)`` between pieces (none after the last).

    >>> done = []; in_steps(10, 4, lambda lo, n: done.append((lo, n))); done
    [(0, 4), (4, 4), (8, 2)]
    """
    size = step if step and step < nbytes else max(nbytes, 1)
    for lo in range(0, nbytes, size):
        started = time.perf_counter()
        do(lo, min(size, nbytes - lo))
        if between is not None and lo + size < nbytes:
            between(time.perf_counter() - started)


def _populate(addr: int, n: int) -> None:
    if _LIBC.madvise(addr, n, _MADV_POPULATE_WRITE) != 0:
        err = ctypes.get_errno()
        if err != errno.EINVAL:  # (EINVAL: a kernel without it; pages then fault in at use)
            raise OSError(err, f"could not allocate {n} bytes of mapped memory: {os.strerror(err)}")


def _register(addr: int, n: int) -> None:
    err = int(getattr(torch.cuda.cudart().cudaHostRegister(addr, n, 0), "value", 0) or 0)
    if err:
        cleared = clear_cuda_error()  # (the error would stay pending for the next CUDA call)
        raise RuntimeError(f"cudaHostRegister of {n} bytes failed: error {err}"
                           + ("" if cleared else " (the runtime's last error could not be cleared)"))


def _unmap(addr: int, nbytes: int, fd: int, state: dict[str, bool]) -> None:
    """The last tensor over the mapping is gone: unlock, unmap, close."""
    if state["pinned"]:
        torch.cuda.cudart().cudaHostUnregister(addr)
    _LIBC.munmap(addr, nbytes)
    os.close(fd)
