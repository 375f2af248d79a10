"""The few CUDA calls a restore and the restore server make themselves, through ctypes.

Both load the libcudart torch loaded (``pipeline.sources.direct_copies.cudart_path``), so
they share torch's CUDA contexts; nothing here is in torch's API: IPC handles of raw
allocations (``cudaIpcGetMemHandle`` on the base of a caching-allocator segment, as the
direct-copy helpers use). ctypes releases the GIL for every call.

:func:`segment` (the allocation holding a pointer), :func:`mem_handle`, :func:`bus_id`
(devices are named by PCI bus id: device numbers differ between processes with another
``CUDA_VISIBLE_DEVICES``); :class:`IpcHandle` as it travels; :func:`cudart` and
:func:`check` for the server's own calls (``gpusnap.serving.cuda_runtime``).
"""

from __future__ import annotations

import ctypes
import functools

from gpusnap.restore.pipeline.sources.direct_copies import cudart_path

__all__ = ["CudaError", "IpcHandle", "bus_id", "check", "cudart", "mem_handle", "segment"]


class CudaError(RuntimeError):
    pass


class IpcHandle(ctypes.Structure):
    """``cudaIpcMemHandle_t``: 64 opaque bytes, NUL bytes included."""

    _fields_ = [("reserved", ctypes.c_char * 64)]

    @classmethod
    def from_bytes(cls, raw: bytes) -> IpcHandle:
        handle = cls()
        ctypes.memmove(ctypes.byref(handle), raw, 64)
        return handle

    def to_bytes(self) -> bytes:
        return bytes(self)  # (all 64 bytes: the field itself would stop at the first NUL)


@functools.cache
def cudart() -> ctypes.CDLL:
    """The libcudart torch loaded, with the argument types of the calls made here."""
    lib = ctypes.CDLL(cudart_path())
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(IpcHandle), vp]
    lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(vp), IpcHandle, ctypes.c_uint]
    lib.cudaIpcCloseMemHandle.argtypes = [vp]
    lib.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
    lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
    lib.cudaStreamDestroy.argtypes = [vp]
    lib.cudaEventCreateWithFlags.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
    lib.cudaEventRecord.argtypes = [vp, vp]
    lib.cudaEventSynchronize.argtypes = [vp]
    lib.cudaEventDestroy.argtypes = [vp]
    lib.cudaDeviceGetPCIBusId.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    return lib


@functools.cache
def _driver() -> ctypes.CDLL:
    from gpusnap.device import libcuda

    lib = libcuda()
    lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.c_uint64]
    return lib


def check(err: int, what: str) -> None:
    """Raise :class:`CudaError` for a failed call ``what``."""
    if err:
        cudart().cudaGetLastError()  # (clear it: a later call must not report it again)
        raise CudaError(f"{what} failed: CUDA error {err}")


def segment(ptr: int) -> tuple[int, int]:
    """``(base, size)`` of the ``cudaMalloc`` allocation holding device address ``ptr`` (the
    caching allocator carves tensors out of larger segments; an IPC handle names a segment)."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    err = _driver().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if err:
        raise CudaError(f"cuMemGetAddressRange failed: CUDA error {err}")
    return base.value, size.value


def mem_handle(base: int) -> bytes:
    """``cudaIpcGetMemHandle`` of the allocation at ``base`` (64 bytes). Fails for memory not
    from ``cudaMalloc`` (``expandable_segments``, ``cudaMallocAsync`` pools)."""
    handle = IpcHandle()
    check(cudart().cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(base)), "cudaIpcGetMemHandle")
    return handle.to_bytes()


def bus_id(index: int) -> str:
    """The PCI bus id of CUDA device ``index`` of this process (``0000:1b:00.0``), lower case."""
    buf = ctypes.create_string_buffer(32)
    check(cudart().cudaDeviceGetPCIBusId(buf, 32, index), "cudaDeviceGetPCIBusId")
    return buf.value.decode().lower()
