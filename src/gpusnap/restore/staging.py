"""Host regions that pieces are read into on their way to the targets, reused across restores.

A region is busy from ``acquire`` (a reader) until the device copy that reads it has run;
only the copy thread (``restore.copier``) knows when that is, so only it calls ``release``.
Readers therefore never touch CUDA: acquiring a region is a plain queue wait. Pinned memory
is slow to allocate, so the pool is made once per ``Restorer`` and kept (DESIGN.md pitfalls).
"""

from __future__ import annotations

import queue

import torch

from gpusnap.device import host_buffer

__all__ = ["SlotPool"]


class SlotPool:
    """``slots`` host regions of ``slot_bytes`` each, page-locked when ``pinned``.

    >>> pool = SlotPool(2, 512, pinned=False)
    >>> slot = pool.acquire(); pool.release(slot); pool.available()
    2
    """

    def __init__(self, slots: int, slot_bytes: int, *, pinned: bool) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError("a slot pool needs at least one slot of at least one byte")
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.pinned = pinned and torch.cuda.is_available()
        self.nbytes = slots * slot_bytes
        self._backing = host_buffer(self.nbytes, pinned=self.pinned)
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        self._views: dict[int, memoryview] = {}
        for i in range(slots):
            region = self._backing[i * slot_bytes : (i + 1) * slot_bytes]
            self._views[id(region)] = memoryview(region.numpy())
            self._free.put(region)

    def fits(self, slot_bytes: int, *, pinned: bool) -> bool:
        """Whether this pool can serve a restore of chunks up to ``slot_bytes`` (a piece is as
        many whole chunks as a region holds)."""
        return slot_bytes <= self.slot_bytes and (self.pinned or not (pinned and torch.cuda.is_available()))

    def acquire(self) -> torch.Tensor:
        """A free region; blocks until the copy thread gives one back."""
        return self._free.get()

    def bytes_of(self, slot: torch.Tensor) -> memoryview:
        """``slot``'s bytes as a memoryview, made once: readers slice it without a torch call
        (each torch call gives up the GIL, and the copy thread waits to get it back)."""
        return self._views[id(slot)]

    def release(self, slot: torch.Tensor) -> None:
        """Give ``slot`` back: no pending device copy reads it any more."""
        self._free.put(slot)

    def available(self) -> int:
        return self._free.qsize()
