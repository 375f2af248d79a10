"""How much device memory a suspend gave back, and the memory a resume takes.

On CUDA the driver is asked (``cudaMemGetInfo``: memory free for any process on the device,
so another process's allocations meanwhile blur it) and so is torch's caching allocator
(``memory_reserved``: what it holds from the driver). On CPU there is no driver to ask: the
bytes of the storages freed are what went back to the allocator.

A resume allocates the state from a memory pool of its own (:func:`own_pool`): were its
storages mixed into the caching allocator's shared segments, a tensor the program makes later
could take the rest of such a segment, and the next suspend could not give that segment back
(``empty_cache`` frees only segments with nothing in them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["Reading", "give_back", "own_pool", "read"]


@dataclass(frozen=True)
class Reading:
    free: int  # bytes the driver reports free, summed over the devices (0 on CPU)
    reserved: int  # bytes torch's caching allocator holds from the driver (0 on CPU)


def read(devices: Iterable[torch.device]) -> Reading:
    free = reserved = 0
    for device in devices:
        if device.type == "cuda":
            free += torch.cuda.mem_get_info(device)[0]
            reserved += torch.cuda.memory_reserved(device)
    return Reading(free, reserved)


def give_back(devices: Iterable[torch.device]) -> None:
    """Return the allocator's unused cached memory to the driver, so another process can use it."""
    if any(d.type == "cuda" for d in devices):
        torch.cuda.empty_cache()


def own_pool(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Allocations of this thread on ``device`` inside come from a new private pool.

    The pool object is let go on exit: nothing else can allocate from it, and the caching
    allocator counts it as freeable, so ``empty_cache()`` gives each of its segments back to
    the driver once the storages on it are freed (by the next suspend). Where no such pool
    can be made (a torch without per-thread pool routing, whose older ``use_mem_pool`` sent
    every thread's allocations there; an allocator that refuses pools, such as a pluggable
    one) the allocations come from the shared pool, as before.
    """
    if device.type != "cuda" or not hasattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool"):
        return contextlib.nullcontext()
    return _Routed(device)


class _Routed(contextlib.AbstractContextManager[None]):
    """This thread's allocations on ``device`` routed to a new pool while inside (none where
    the pool cannot be made or entered); the pool goes with the routing on exit."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._routed: contextlib.AbstractContextManager[None] | None = None

    def __enter__(self) -> None:
        try:
            routed = torch.cuda.use_mem_pool(torch.cuda.MemPool(), self._device)
            routed.__enter__()
        except (RuntimeError, AttributeError, TypeError):
            return  # (the shared pool, as before)
        self._routed = routed

    def __exit__(self, *exc: object) -> None:
        routed, self._routed = self._routed, None
        if routed is not None:
            routed.__exit__(None, None, None)
