"""One helper process of ``inplace_procs.py``: page-lock parts of a file's read-only map in
place and copy each straight to a device buffer that the parent shares over CUDA IPC.

Standard library only (libcudart through ctypes), so it starts without importing torch.
Protocol, one JSON line each way on stdin/stdout: the job; ``{"ready": setup_s}``; the line
``go``; ``{"done": ..timings..}``; then it unregisters, closes and exits.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import sys
import time


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def check(err: int, what: str) -> None:
    if err != 0:
        raise RuntimeError(f"{what} failed: cudaError {err}")


def main() -> None:
    t0 = time.perf_counter()
    job = json.loads(sys.stdin.readline())
    lib = ctypes.CDLL(job["lib"])
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    lib.cudaHostRegister.argtypes = [vp, sz, ctypes.c_uint]
    lib.cudaHostUnregister.argtypes = [vp]
    lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(vp), IpcHandle, ctypes.c_uint]
    lib.cudaIpcCloseMemHandle.argtypes = [vp]
    lib.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
    lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
    lib.cudaStreamSynchronize.argtypes = [vp]
    check(lib.cudaSetDevice(job["device"]), "cudaSetDevice")
    handle = IpcHandle()
    ctypes.memmove(ctypes.byref(handle), bytes.fromhex(job["handle"]), 64)
    base = vp()
    check(lib.cudaIpcOpenMemHandle(ctypes.byref(base), handle, 1), "cudaIpcOpenMemHandle")
    stream = vp()
    check(lib.cudaStreamCreateWithFlags(ctypes.byref(stream), 1), "cudaStreamCreate")
    fd = os.open(job["path"], os.O_RDONLY)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = vp
    libc.mmap.argtypes = [vp, sz, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    addr = libc.mmap(None, job["size"], mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    os.close(fd)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    dst = base.value + job["offset"]
    sys.stdout.write(json.dumps({"ready": time.perf_counter() - t0}) + "\n")
    sys.stdout.flush()
    if sys.stdin.readline().strip() != "go":
        return
    t1 = time.perf_counter()
    reg_s = 0.0
    done = []
    for file_off, dst_off, n in job["parts"]:
        r = time.perf_counter()
        check(lib.cudaHostRegister(addr + file_off, n, 8), "cudaHostRegister")  # 8: read-only
        reg_s += time.perf_counter() - r
        check(lib.cudaMemcpyAsync(dst + dst_off, addr + file_off, n, 1, stream), "cudaMemcpyAsync")
        done.append(file_off)
    issued = time.perf_counter() - t1
    check(lib.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
    wall = time.perf_counter() - t1
    sys.stdout.write(json.dumps({"done": {"wall_s": wall, "reg_s": reg_s, "issued_s": issued}}) + "\n")
    sys.stdout.flush()
    u = time.perf_counter()
    for (file_off, _, n) in job["parts"]:
        lib.cudaHostUnregister(addr + file_off)
    lib.cudaIpcCloseMemHandle(base)
    sys.stdout.write(json.dumps({"closed": time.perf_counter() - u}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
