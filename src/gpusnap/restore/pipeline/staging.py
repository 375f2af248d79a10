"""Host regions that pieces are read into on their way to the targets, reused across restores.

A region is busy from ``acquire`` (a reader) until the device copy that reads it has run;
only the copy thread (``pipeline.copier``) knows when that is. Regions travel as owned
``pipeline.sources.source.Region`` objects, whose one ``release`` calls :meth:`SlotPool.release`
exactly once, whoever holds them when the load ends or fails. Readers never touch CUDA:
acquiring a region is a plain queue wait. Pinned memory
is slow to allocate, so the pool is made once per ``Restorer`` and kept (DESIGN.md pitfalls).
"""

from __future__ import annotations

import os
import queue

import torch

from gpusnap.device import host_buffer
from gpusnap.host_map import MappedMemory

__all__ = ["SlotPool", "SharedMemory"]


class SharedMemory(MappedMemory):
    """``nbytes`` of memory other processes can map (a ``memfd``), page-locked for CUDA
    copies when ``pinned``: reader processes (``sources/reader_procs.py``) fill it, this
    process copies out of it through ``tensor`` (and views of it). Raises ``OSError`` (no
    memfd, no memory) or ``RuntimeError`` (page-locking failed); the caller then uses
    ordinary memory.
    """

    def __init__(self, nbytes: int, *, pinned: bool) -> None:
        fd = os.memfd_create("gpusnap-restore", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        super().__init__(fd, nbytes, pinned=pinned)


def can_share() -> bool:
    """Whether shared regions (and so reader processes) are possible here (Linux memfd)."""
    return hasattr(os, "memfd_create")


class SlotPool:
    """``slots`` host regions of ``slot_bytes`` each, page-locked when ``pinned``; in memory
    reader processes can map when ``shared`` (``self.shared.fd``; region ``r`` starts at
    ``offset_of(r)``). ``backing``: slots over that memory instead, allocated by the caller
    (the direct-copy landing slots on a device: ``sources.direct_copies``; no ``bytes_of`` there).

    >>> pool = SlotPool(2, 512, pinned=False)
    >>> slot = pool.acquire(); pool.release(slot); pool.available()
    2
    """

    def __init__(self, slots: int, slot_bytes: int, *, pinned: bool, shared: bool = False,
                 backing: torch.Tensor | None = None) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError("a slot pool needs at least one slot of at least one byte")
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.pinned = pinned and torch.cuda.is_available()
        self.nbytes = slots * slot_bytes
        self.shared: SharedMemory | None = None
        if backing is not None:
            self._backing = backing
        elif shared:
            self.shared = SharedMemory(self.nbytes, pinned=self.pinned)
            self._backing = self.shared.tensor
        else:
            self._backing = host_buffer(self.nbytes, pinned=self.pinned)
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        self._views: dict[int, memoryview] = {}
        self._offsets: dict[int, int] = {}
        for i in range(slots):
            region = self._backing[i * slot_bytes : (i + 1) * slot_bytes]
            if region.device.type == "cpu":
                self._views[id(region)] = memoryview(region.numpy())
            self._offsets[id(region)] = i * slot_bytes
            self._free.put(region)

    def fits(self, slot_bytes: int, *, pinned: bool, shared: bool = False) -> bool:
        """Whether this pool can serve a restore of chunks up to ``slot_bytes`` (a piece is as
        many whole chunks as a region holds)."""
        return (slot_bytes <= self.slot_bytes and (self.pinned or not (pinned and torch.cuda.is_available()))
                and (self.shared is not None or not shared))

    def offset_of(self, slot: torch.Tensor) -> int:
        """Where ``slot`` starts in the pool's memory (in ``shared``, for reader processes)."""
        return self._offsets[id(slot)]

    def owns(self, slot: torch.Tensor) -> bool:
        return id(slot) in self._offsets

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
