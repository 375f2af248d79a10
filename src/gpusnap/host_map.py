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
import weakref

import torch

from gpusnap.device import clear_cuda_error

__all__ = ["MappedMemory"]

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

    Raises ``OSError`` (the map failed) or ``RuntimeError`` (page-locking failed; nothing
    stays mapped); the caller then decides what to fall back to.
    """

    def __init__(self, fd: int, nbytes: int, *, pinned: bool, populate: bool = True) -> None:
        self.nbytes = nbytes
        self.fd = fd
        addr = _LIBC.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, f"mmap of {nbytes} bytes failed: {os.strerror(err)}")
        if populate and nbytes and _LIBC.madvise(addr, nbytes, _MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            if err != errno.EINVAL:  # (EINVAL: a kernel without it; pages then fault in at use)
                _LIBC.munmap(addr, nbytes)
                os.close(fd)
                raise OSError(err, f"could not allocate {nbytes} bytes of mapped memory: {os.strerror(err)}")
        self.address = addr
        memory = type("_Mapping", (ctypes.c_uint8 * nbytes,), {}).from_address(addr)
        state = {"pinned": False}
        weakref.finalize(memory, _unmap, addr, nbytes, fd, state)
        self.tensor = torch.frombuffer(memory, dtype=torch.uint8)  # keeps ``memory`` alive
        del memory
        self.pinned = False
        if pinned:
            cudart = torch.cuda.cudart()
            err = int(getattr(cudart.cudaHostRegister(addr, nbytes, 0), "value", 0) or 0)
            if err:
                del self.tensor
                cleared = clear_cuda_error()  # (the error would stay pending for the next CUDA call)
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: error {err}"
                                   + ("" if cleared else " (the runtime's last error could not be cleared)"))
            state["pinned"] = self.pinned = True


def _unmap(addr: int, nbytes: int, fd: int, state: dict[str, bool]) -> None:
    """The last tensor over the mapping is gone: unlock, unmap, close."""
    if state["pinned"]:
        torch.cuda.cudart().cudaHostUnregister(addr)
    _LIBC.munmap(addr, nbytes)
    os.close(fd)
