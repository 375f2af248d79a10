"""A bounded pool of host staging slots, allocated once and reused across saves.

Pinned memory is slow to allocate (seconds for GBs), so the pool is created on first use
and kept by the Checkpointer; ``acquire`` blocks when every slot is in use, which is what
bounds host memory during a save (DESIGN.md invariant 4).
"""

from __future__ import annotations

import queue

import torch

from gpusnap.device import host_buffer

__all__ = ["StagingPool"]


class StagingPool:
    """``slots`` host buffers of ``slot_bytes`` each (page-locked when ``pinned``)."""

    def __init__(self, slots: int, slot_bytes: int, *, pinned: bool) -> None:
        if slots < 1:
            raise ValueError("a staging pool needs at least one slot")
        self.slot_bytes = slot_bytes
        self.pinned = pinned
        self.nbytes = slots * slot_bytes
        self._backing = host_buffer(self.nbytes, pinned=pinned)
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        for i in range(slots):
            self._free.put(self._backing[i * slot_bytes : (i + 1) * slot_bytes])

    @property
    def slots(self) -> int:
        return self.nbytes // self.slot_bytes

    def acquire(self) -> torch.Tensor:
        """A free slot (uint8, ``slot_bytes`` long); blocks until one is released."""
        return self._free.get()

    def release(self, slot: torch.Tensor) -> None:
        self._free.put(slot)

    def available(self) -> int:
        return self._free.qsize()
