"""How much device memory a suspend gave back.

On CUDA the driver is asked (``cudaMemGetInfo``: memory free for any process on the device,
so another process's allocations meanwhile blur it) and so is torch's caching allocator
(``memory_reserved``: what it holds from the driver). On CPU there is no driver to ask: the
bytes of the storages freed are what went back to the allocator.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["Reading", "give_back", "read"]


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
