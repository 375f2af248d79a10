"""The one place that knows about CUDA. Every path above it also runs on CPU tensors.

Copies between a device and the host go through :func:`to_host` / :func:`host_buffer`
so that the CPU machine (CI) exercises the same code as the GPU machine.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Iterable

import torch

__all__ = [
    "OWN_STREAMS",
    "clear_cuda_error",
    "device_exists",
    "host_buffer",
    "is_accelerator",
    "libcuda",
    "loaded_cudart_path",
    "outside_graph_captures",
    "own_stream",
    "synchronize",
    "to_host",
    "waitable_event",
]


def is_accelerator(device: torch.device) -> bool:
    """True for devices whose memory is not directly readable by the CPU."""
    return device.type not in ("cpu", "meta")


def device_exists(name: str) -> bool:
    """Whether a tensor can be allocated on ``name`` (e.g. ``"cuda:1"``) in this process."""
    device = torch.device(name)
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        index = device.index or 0
        return torch.cuda.is_available() and index < torch.cuda.device_count()
    return False


def host_buffer(nbytes: int, *, pinned: bool) -> torch.Tensor:
    """A uint8 host tensor; page-locked only when asked and CUDA is present."""
    pin = pinned and torch.cuda.is_available()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def to_host(data: torch.Tensor, *, copy: bool) -> torch.Tensor:
    """Bytes of ``data`` (uint8) on the host. Without ``copy``, CPU data is aliased."""
    if data.device.type == "cpu":
        return data.clone() if copy else data
    out = host_buffer(data.numel(), pinned=False)
    out.copy_(data)  # synchronous: orders after all work already enqueued on the stream
    return out


def synchronize(device: torch.device) -> None:
    """Wait for all work on ``device`` (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def waitable_event() -> torch.cuda.Event:
    """A CUDA event that a host thread may wait on, sleeping rather than spinning.

    Default events spin in ``synchronize()``; a dozen gpusnap threads spinning on events
    compete with the program's own kernel launches for the CPU and the driver, which slowed a
    training step down while a capture ran. Use this for every event a thread waits on.
    """
    return torch.cuda.Event(blocking=True)


_thread = threading.local()
_CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1


def outside_graph_captures() -> bool:
    """Let this (gpusnap) thread keep calling CUDA while the program captures a CUDA graph.

    ``torch.cuda.graph`` captures in the driver's *global* mode: while it captures, any other
    thread's "unsafe" call (an event wait or query, an allocation) fails and invalidates the
    program's capture (as a save's copier did, running beside one). gpusnap's threads
    never capture, so they switch themselves to *thread-local* mode, in which only a thread's
    own captures restrict it (what PyTorch's NCCL watchdog thread does). Call it on the thread,
    before its first CUDA call; cheap to repeat. Returns whether the mode is set.
    """
    if getattr(_thread, "relaxed", False):
        return True
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    try:
        exchange = libcuda().cuThreadExchangeStreamCaptureMode
    except (OSError, AttributeError):
        return False
    mode = ctypes.c_int(_CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    _thread.relaxed = exchange(ctypes.byref(mode)) == 0  # CUDA_SUCCESS
    return _thread.relaxed


_CU_STREAM_NON_BLOCKING = 1
OWN_STREAMS = 8  # per device and priority; then handed out again, round-robin
_own_streams: dict[tuple[int, int], list[torch.cuda.ExternalStream]] = {}
_own_handed: dict[tuple[int, int], int] = {}  # streams handed out so far, per device and priority
_own_streams_lock = threading.Lock()


def own_stream(device: torch.device, priority: int = 0) -> torch.cuda.Stream:
    """A CUDA stream of gpusnap's own on ``device``, never one of torch's pooled streams.

    ``torch.cuda.Stream()`` hands out a fixed pool of streams round-robin, and
    ``torch.cuda.graph`` takes its default capture stream from the same pool: once a process
    has made enough streams, a gpusnap copy stream could be the very stream the program
    captures a CUDA graph on, and its copies and events would land in (and break) the
    program's capture. gpusnap keeps a pool of its own instead, handed out the same way (so
    a save's copies, a restore's and a promotion's hashing run on different streams), made
    by the driver and never destroyed. ``priority`` as torch's (lower numbers run first).
    Callers keep the stream they get."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, priority)
    with _own_streams_lock:
        pool = _own_streams.setdefault(key, [])
        handed = _own_handed.get(key, 0)
        _own_handed[key] = handed + 1
        if len(pool) < OWN_STREAMS:
            pool.append(torch.cuda.ExternalStream(_new_stream(index, priority), device=torch.device("cuda", index)))
            return pool[-1]
        return pool[handed % OWN_STREAMS]


def _new_stream(index: int, priority: int) -> int:
    """A new non-blocking stream in the device's primary context (torch's), by the driver."""
    lib = libcuda()
    device, context = ctypes.c_int(), ctypes.c_void_p()
    stream = ctypes.c_void_p()
    _cu(lib, "cuDeviceGet", ctypes.byref(device), ctypes.c_int(index))
    _cu(lib, "cuDevicePrimaryCtxRetain", ctypes.byref(context), device)  # (held for the process)
    _cu(lib, "cuCtxPushCurrent_v2", context)
    try:
        _cu(lib, "cuStreamCreateWithPriority", ctypes.byref(stream), ctypes.c_uint(_CU_STREAM_NON_BLOCKING),
            ctypes.c_int(priority))
    finally:
        _cu(lib, "cuCtxPopCurrent_v2", ctypes.byref(ctypes.c_void_p()))
    assert stream.value is not None
    return stream.value


def _cu(lib: ctypes.CDLL, name: str, *args: object) -> None:
    rc = getattr(lib, name)(*args)
    if rc != 0:
        raise RuntimeError(f"{name} failed with CUDA driver error {rc}")


def _forget_streams_in_child() -> None:
    global _own_streams_lock
    _own_streams.clear()  # (a forked child cannot use its parent's CUDA context)
    _own_handed.clear()
    _own_streams_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_streams_in_child)


@functools.cache
def libcuda() -> ctypes.CDLL:
    """The CUDA driver library torch already loaded (``OSError`` where there is none)."""
    return ctypes.CDLL("libcuda.so.1")


def loaded_cudart_path() -> str | None:
    """The file of the libcudart this process's torch loaded, or None (linked statically, or
    its file replaced on disk since: the map then names a deleted file)."""
    torch.cuda.init()
    with open("/proc/self/maps") as f:
        return cudart_in_maps(f)


def cudart_in_maps(lines: Iterable[str]) -> str | None:
    """The libcudart file named in ``/proc/self/maps`` lines (the first by name), or None."""
    paths = set()
    for line in lines:
        fields = line.rstrip("\n").split(maxsplit=5)  # (a path may hold spaces)
        if len(fields) == 6 and "libcudart" in fields[5].rsplit("/", 1)[-1] and not fields[5].endswith(" (deleted)"):
            paths.add(fields[5])
    return min(paths) if paths else None


def clear_cuda_error() -> bool:
    """Read (and so clear) the runtime's last error after a call gpusnap let fail (a refused
    ``cudaHostRegister``), so the program's next CUDA call does not report it. torch's
    ``torch.cuda.cudart()`` has no ``cudaGetLastError``: the runtime torch loaded is called.
    Best effort: returns whether it could (the failure being handled is the one to report)."""
    try:
        path = loaded_cudart_path()
        if path is None:
            return False
        ctypes.CDLL(path).cudaGetLastError()
        return True
    except (OSError, AttributeError):
        return False


def only_gpu(devices: Iterable[torch.device]) -> torch.device | None:
    """The one CUDA device (with its index) among ``devices``, or None when they are not
    exactly one CUDA device: where work for those targets goes (a pool thread's own current
    device is not theirs)."""
    found = set(devices)
    if len(found) != 1:
        return None
    (device,) = found
    return device if device.type == "cuda" and device.index is not None else None
