"""The few CUDA calls the restore server and its clients make themselves, through ctypes.

Both load the libcudart torch loaded (``restore.direct.cudart_path``), so they share torch's
CUDA contexts; nothing here is in torch's API: IPC handles of raw allocations
(``cudaIpcGetMemHandle`` on the base of a caching-allocator segment, as the direct-copy
helpers use), opening them in the server, and its host-to-device copies. ctypes releases the
GIL for every call.

Client: :func:`segment` (the allocation holding a pointer), :func:`mem_handle`,
:func:`bus_id` (devices are named by PCI bus id: device numbers differ between processes
with another ``CUDA_VISIBLE_DEVICES``). Server: :class:`Runtime`.
"""

from __future__ import annotations

import ctypes
import functools
import threading

__all__ = ["CudaError", "Runtime", "bus_id", "mem_handle", "segment"]

H2D = 1  # cudaMemcpyHostToDevice
NON_BLOCKING = 1  # cudaStreamNonBlocking: no ordering with the legacy default stream
BLOCKING_SYNC_NO_TIMING = 0x1 | 0x2  # cudaEventBlockingSync | cudaEventDisableTiming: the host sleeps
LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


class CudaError(RuntimeError):
    pass


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


@functools.cache
def _cudart() -> ctypes.CDLL:
    from gpusnap.restore.direct import cudart_path

    lib = ctypes.CDLL(cudart_path())
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), vp]
    lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(vp), _IpcHandle, ctypes.c_uint]
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


def _check(err: int, what: str) -> None:
    if err:
        _cudart().cudaGetLastError()  # (clear it: a later call must not report it again)
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
    handle = _IpcHandle()
    _check(_cudart().cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(base)), "cudaIpcGetMemHandle")
    return bytes(handle)  # (all 64 bytes: the field itself would stop at the first NUL)


def bus_id(index: int) -> str:
    """The PCI bus id of CUDA device ``index`` of this process (``0000:1b:00.0``), lower case."""
    buf = ctypes.create_string_buffer(32)
    _check(_cudart().cudaDeviceGetPCIBusId(buf, 32, index), "cudaDeviceGetPCIBusId")
    return buf.value.decode().lower()


class Runtime:
    """The server's CUDA: device ``index``; opened IPC handles counted, so that two requests
    naming one allocation (two restores of one client at once) share one mapping (CUDA maps a
    handle once per process)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.lib = _cudart()
        self._open: dict[bytes, list[int]] = {}  # handle -> [base, users]
        self._lock = threading.Lock()

    def bind(self) -> None:
        """Make the device current on this thread (the runtime's current device is per thread)."""
        _check(self.lib.cudaSetDevice(self.index), "cudaSetDevice")

    def open(self, handle: bytes) -> tuple[int, int | None]:
        """Map the client's allocation: its base here, and its size (None: the driver does not
        say; the client's word stands)."""
        with self._lock:
            entry = self._open.get(handle)
            if entry is None:
                raw = _IpcHandle()
                ctypes.memmove(ctypes.byref(raw), handle, 64)
                base = ctypes.c_void_p()
                _check(self.lib.cudaIpcOpenMemHandle(ctypes.byref(base), raw, LAZY_PEER_ACCESS), "cudaIpcOpenMemHandle")
                entry = self._open[handle] = [base.value or 0, 0]
            entry[1] += 1
        try:
            return entry[0], segment(entry[0])[1]
        except CudaError:
            return entry[0], None

    def close(self, handle: bytes) -> None:
        with self._lock:
            entry = self._open.get(handle)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._open[handle]
                self.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(entry[0]))

    def stream(self) -> Stream:
        return Stream(self.lib)


class Stream:
    """A non-blocking stream of the current device, and an event to wait for it by sleeping."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.handle = ctypes.c_void_p()
        self.event = ctypes.c_void_p()
        _check(lib.cudaStreamCreateWithFlags(ctypes.byref(self.handle), NON_BLOCKING), "cudaStreamCreateWithFlags")
        _check(lib.cudaEventCreateWithFlags(ctypes.byref(self.event), BLOCKING_SYNC_NO_TIMING), "cudaEventCreate")

    def copy(self, dst: int, src: int, n: int) -> None:
        _check(self.lib.cudaMemcpyAsync(dst, src, n, H2D, self.handle), "cudaMemcpyAsync")

    def wait(self) -> None:
        """Until every copy queued on it has completed."""
        _check(self.lib.cudaEventRecord(self.event, self.handle), "cudaEventRecord")
        _check(self.lib.cudaEventSynchronize(self.event), "cudaEventSynchronize")

    def destroy(self) -> None:
        self.lib.cudaEventDestroy(self.event)
        self.lib.cudaStreamDestroy(self.handle)
