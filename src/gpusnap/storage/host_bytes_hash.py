"""The device hash (nh128) of host bytes, computed on a GPU when this process has one up.

The fast tier names each chunk by the hash its device computed at the consistent point, and
checks the slab bytes against it before a promotion or a read trusts them. On the host that
hash is torch's CPU implementation: ~100 CPU-s for an 11.4 GB checkpoint,
spread over torch's intra-op threads, which run beside the training loop whatever the calling
thread's priority (a promoted save then cost training 7 s). On the device it is one
host-to-device copy (page-locked slab memory: DMA) and one kernel per chunk, on a stream of
its own; both implementations give the same bits (``kernels/chunk_hash.py``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Iterable

import torch

from gpusnap import launch_hooks
from gpusnap.device import outside_graph_captures, own_stream, waitable_event
from gpusnap.kernels.chunk_hash import chunk_hashes, hex_rows

__all__ = ["hash_host_bytes", "hash_device"]

log = logging.getLogger("gpusnap")

_local = threading.local()  # this thread's (device, stream, scratch): promotion pool threads each have one


def hash_device(devices: Iterable[str]) -> torch.device | None:
    """The GPU to hash a checkpoint's chunks on: the first CUDA device its spans lived on, if
    this process has CUDA up; else None (the host). A process that has not initialized CUDA
    (a CLI verify) is not made to, and each rank hashes on its own GPU."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return next((torch.device(d) for d in devices if d.startswith("cuda")), None)


def hash_host_bytes(data: bytes | memoryview, chunk_size: int, device: torch.device | None = None, *,
                    slice_bytes: int | None = None) -> list[str]:
    """The hex device hashes of ``data``'s ``chunk_size``-byte chunks (a multiple of 16),
    computed on ``device`` (None: the host). ``data`` stays where it is; on a device it is
    copied into this thread's scratch first, ``slice_bytes`` at a time when given (a whole
    number of chunks: this thread's scratch stays that small). A device that cannot take it
    (out of memory, a CUDA error) leaves the hash to the host, with a warning once."""
    with warnings.catch_warnings():  # (a read-only buffer: the hash only reads it)
        warnings.simplefilter("ignore", UserWarning)
        host = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    if device is not None and not _resting(device):
        step = max(chunk_size, (slice_bytes // chunk_size) * chunk_size) if slice_bytes else max(1, host.numel())
        try:
            return [h for at in range(0, max(1, host.numel()), step)
                    for h in _on_device(host[at : at + step], chunk_size, device)]
        except _DEVICE_ERRORS as exc:  # (the bytes are still on the host)
            _rest(device, exc)
    return hex_rows(chunk_hashes(host, chunk_size).numpy())


# out of memory, or a CUDA error (torch's AcceleratorError where it has one); anything else
# is a bug of ours and raises
_DEVICE_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError,) + (
    (torch.AcceleratorError,) if hasattr(torch, "AcceleratorError") else ())
REST_S = 30.0  # after a failure, a device is left alone this long: each retry of a failing
# allocation would make the caching allocator free the program's whole cache first
_rested: dict[str, float] = {}
_rest_lock = threading.Lock()


def _resting(device: torch.device) -> bool:
    with _rest_lock:
        until = _rested.get(str(device))
    return until is not None and time.monotonic() < until


def _rest(device: torch.device, exc: BaseException) -> None:
    with _rest_lock:
        first = str(device) not in _rested
        _rested[str(device)] = time.monotonic() + REST_S
    if first:
        log.warning("gpusnap: hashing chunks on %s failed (%s); they are hashed on the host for the next %.0f s "
                    "(slower)", device, exc, REST_S)


def _on_device(host: torch.Tensor, chunk_size: int, device: torch.device) -> list[str]:
    if device.type == "cuda":
        outside_graph_captures()  # (the program may be capturing a graph meanwhile)
    stream, scratch = _scratch(device, host.numel())
    on_device = torch.cuda.device(device) if stream is not None else contextlib.nullcontext()
    on_stream = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with launch_hooks.internal(), on_device, on_stream:  # (a CPU scratch: the tests' device)
        part = scratch[: host.numel()]
        part.copy_(host, non_blocking=True)
        rows = chunk_hashes(part, chunk_size)
        if stream is not None:
            # the thread sleeps until the stream is done: a plain .cpu() spins a core in the
            # driver meanwhile, and a promotion's threads each spinning took training's cores
            done = waitable_event()
            done.record(stream)
            done.synchronize()
        rows = rows.cpu()  # (waits for this stream only)
    return hex_rows(rows.numpy())


def _scratch(device: torch.device, nbytes: int) -> tuple[torch.cuda.Stream | None, torch.Tensor]:
    have = getattr(_local, "scratch", None)
    if have is not None and have[0] == device and have[2].numel() >= nbytes:
        return have[1], have[2]
    stream = have[1] if have is not None and have[0] == device else None
    if stream is None and device.type == "cuda":
        low, _high = torch.cuda.Stream.priority_range()
        stream = own_stream(device, low)  # (never a pooled stream: device.py)
    have = _local.scratch = None  # (a smaller scratch goes back to the pool before a larger one is made)
    # Allocated on the stream that uses it. A block the caching allocator hands out on the
    # program's stream may be memory that kernels the program queued before freeing it still
    # read or write: our copy on another stream would race them both ways (a good chunk seen
    # as corrupt, or the program reading our bytes).
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        buf = torch.empty(max(nbytes, 16), dtype=torch.uint8, device=device)
    _local.scratch = (device, stream, buf)
    return stream, buf
