"""Host staging memory for captures: pinned slabs, grown on demand, kept across saves.

The copier puts each copy *piece* (up to ``Config.copy_piece_bytes``) into one contiguous
region of a slab; writer threads hash and store the piece's chunks and then release the
region. Each slab is a ring: regions are handed out in order and their space comes back when
every older region of that slab is released (releases may come in any order).

Why this shape: capture must run at device-to-host bandwidth, not at hashing or disk speed, so
the pool grows (up to ``capacity``) until it holds what one window copies, and the next save
reuses it. Pinned memory is slow to allocate (seconds for GBs), so slabs are never freed while
the Checkpointer lives; ``allocate`` blocks when ``capacity`` is reached, which is what bounds
host memory (DESIGN.md invariant 4).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from gpusnap.device import host_buffer

__all__ = ["Region", "StagingArena"]


@dataclass(eq=False)
class Region:
    """``data`` (uint8, host) is ``[start, end)`` of one slab; give it back with ``release``."""

    slab: _Slab
    start: int
    end: int
    data: torch.Tensor = field(repr=False)
    released: bool = False


class _Slab:
    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.buffer = host_buffer(nbytes, pinned=pinned)
        self.size = nbytes
        self.live: deque[Region] = deque()  # allocation order
        self.head = 0  # where the next region starts

    def try_allocate(self, n: int) -> Region | None:
        if not self.live:
            self.head = 0
            return self._take(0, n) if n <= self.size else None
        oldest = self.live[0].start
        if self.head > oldest:  # not wrapped: free space is [head, size) and [0, oldest)
            if self.size - self.head >= n:
                return self._take(self.head, n)
            if oldest >= n:
                return self._take(0, n)
            return None
        if oldest - self.head >= n:  # wrapped: free space is [head, oldest)
            return self._take(self.head, n)
        return None

    def _take(self, start: int, n: int) -> Region:
        region = Region(self, start, start + n, self.buffer[start : start + n])
        self.live.append(region)
        self.head = start + n
        return region

    def release(self, region: Region) -> None:
        region.released = True
        while self.live and self.live[0].released:
            self.live.popleft()


class StagingArena:
    """Up to ``capacity`` bytes of host memory in slabs of ``slab_bytes`` (pinned if asked)."""

    def __init__(self, capacity: int, *, pinned: bool, slab_bytes: int = 256 << 20) -> None:
        if capacity < 1:
            raise ValueError("a staging arena needs a positive capacity")
        self.capacity = capacity
        self.pinned = pinned
        self.slab_bytes = min(slab_bytes, capacity)
        self._slabs: list[_Slab] = []
        self._growing = 0  # bytes of slabs being allocated outside the lock
        self._cond = threading.Condition()
        self.grow_s = 0.0  # time spent allocating slabs (pinned allocation is slow)

    @property
    def nbytes(self) -> int:
        """Host memory held now (slabs are kept for the next save)."""
        return sum(s.size for s in self._slabs)

    def max_region(self) -> int:
        """The largest region ``allocate`` can ever satisfy."""
        return max([self.slab_bytes, *(s.size for s in self._slabs)])

    def allocate(self, n: int) -> Region:
        """A contiguous region of ``n`` bytes; grows the arena or blocks until one is free."""
        while True:
            region = self.try_allocate(n, wait=True)
            if region is not None:
                return region

    def can_grow(self) -> bool:
        """Whether another slab fits within ``capacity``."""
        with self._cond:
            return not self._slabs or self.nbytes + self._growing + self.slab_bytes <= self.capacity

    def try_allocate(self, n: int, *, wait: bool = False) -> Region | None:
        """A region if one is free (growing the arena if allowed), else None (or, with
        ``wait``, None after the next release or growth: call again)."""
        if n < 1 or n > self.max_region():
            raise ValueError(f"cannot stage a piece of {n} bytes (largest region: {self.max_region()})")
        with self._cond:
            for slab in self._slabs:
                region = slab.try_allocate(n)
                if region is not None:
                    return region
            if self.nbytes + self._growing + self.slab_bytes > self.capacity and self._slabs:
                if wait:
                    self._cond.wait()
                return None
            self._growing += self.slab_bytes
        self._grow()  # outside the lock: releases go on while pinned memory is allocated
        return None

    def _grow(self) -> None:
        started = time.perf_counter()
        try:
            slab = _Slab(self.slab_bytes, self.pinned)
        finally:
            with self._cond:
                self._growing -= self.slab_bytes
        with self._cond:
            self.grow_s += time.perf_counter() - started
            self._slabs.append(slab)
            self._cond.notify_all()

    def reserve(self, nbytes: int) -> float:
        """Grow now (on the calling thread) to hold at least ``nbytes`` (within capacity), so
        that no slab is allocated while a window copies; returns the seconds spent."""
        started = time.perf_counter()
        target = min(nbytes, self.capacity)
        while True:
            with self._cond:
                if self.nbytes + self._growing >= target or self.nbytes + self._growing + self.slab_bytes > self.capacity:
                    break
                self._growing += self.slab_bytes
            self._grow()
        return time.perf_counter() - started

    def release(self, region: Region) -> None:
        with self._cond:
            region.slab.release(region)
            self._cond.notify_all()

    def in_use(self) -> int:
        with self._cond:
            return sum(r.end - r.start for s in self._slabs for r in s.live if not r.released)
