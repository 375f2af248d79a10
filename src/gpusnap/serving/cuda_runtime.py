"""The restore server's own CUDA, through ctypes: IPC handles of its clients' allocations
opened (:class:`Runtime`), and its host-to-device copies on a stream of their own
(:class:`Stream`). The calls shared with the client are ``restore.via_server.cuda_ipc``.
"""

from __future__ import annotations

import ctypes
import threading

from gpusnap.restore.via_server.cuda_ipc import CudaError, IpcHandle, check, cudart, segment

__all__ = ["Runtime", "Stream"]

H2D = 1  # cudaMemcpyHostToDevice
NON_BLOCKING = 1  # cudaStreamNonBlocking: no ordering with the legacy default stream
BLOCKING_SYNC_NO_TIMING = 0x1 | 0x2  # cudaEventBlockingSync | cudaEventDisableTiming: the host sleeps
LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


class Runtime:
    """The server's CUDA: device ``index``; opened IPC handles counted, so that two requests
    naming one allocation (two restores of one client at once) share one mapping (CUDA maps a
    handle once per process)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.lib = cudart()
        self._open: dict[bytes, list[int]] = {}  # handle -> [base, users]
        self._lock = threading.Lock()

    def bind(self) -> None:
        """Make the device current on this thread (the runtime's current device is per thread)."""
        check(self.lib.cudaSetDevice(self.index), "cudaSetDevice")

    def open(self, handle: bytes) -> tuple[int, int | None]:
        """Map the client's allocation: its base here, and its size (None: the driver does not
        say; the client's word stands)."""
        with self._lock:
            entry = self._open.get(handle)
            if entry is None:
                raw = IpcHandle.from_bytes(handle)
                base = ctypes.c_void_p()
                check(self.lib.cudaIpcOpenMemHandle(ctypes.byref(base), raw, LAZY_PEER_ACCESS), "cudaIpcOpenMemHandle")
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
        check(lib.cudaStreamCreateWithFlags(ctypes.byref(self.handle), NON_BLOCKING), "cudaStreamCreateWithFlags")
        check(lib.cudaEventCreateWithFlags(ctypes.byref(self.event), BLOCKING_SYNC_NO_TIMING), "cudaEventCreate")

    def copy(self, dst: int, src: int, n: int) -> None:
        check(self.lib.cudaMemcpyAsync(dst, src, n, H2D, self.handle), "cudaMemcpyAsync")

    def wait(self) -> None:
        """Until every copy queued on it has completed."""
        check(self.lib.cudaEventRecord(self.event, self.handle), "cudaEventRecord")
        check(self.lib.cudaEventSynchronize(self.event), "cudaEventSynchronize")

    def destroy(self) -> None:
        self.lib.cudaEventDestroy(self.event)
        self.lib.cudaStreamDestroy(self.handle)
