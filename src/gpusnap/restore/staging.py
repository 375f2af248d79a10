"""Host slots that chunks are read into on their way to the targets, reused across restores.

A slot is busy from ``acquire`` until the device copy that reads it has run: ``release``
takes the CUDA events of those copies and the next ``acquire`` of that slot waits for them,
so a slot is never overwritten under a pending host-to-device copy. Pinned memory is slow to
allocate, so the pool is made once per ``Restorer`` and kept (DESIGN.md pitfalls).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any

import torch

from gpusnap.device import host_buffer

__all__ = ["SlotPool"]


class SlotPool:
    """``slots`` host buffers of ``slot_bytes`` each, page-locked when ``pinned``.

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
        self._events: dict[int, Sequence[Any]] = {}  # slot data_ptr -> copies still reading it
        self._lock = threading.Lock()
        for i in range(slots):
            self._free.put(self._backing[i * slot_bytes : (i + 1) * slot_bytes])

    def fits(self, slot_bytes: int, *, pinned: bool) -> bool:
        """Whether this pool can serve a restore of chunks up to ``slot_bytes``."""
        return slot_bytes <= self.slot_bytes and (self.pinned or not (pinned and torch.cuda.is_available()))

    def acquire(self) -> torch.Tensor:
        """A free slot whose earlier device copies have completed; blocks until one is free."""
        slot = self._free.get()
        with self._lock:
            events = self._events.pop(slot.data_ptr(), ())
        for event in events:
            event.synchronize()
        return slot

    def release(self, slot: torch.Tensor, events: Sequence[Any] = ()) -> None:
        """Give ``slot`` back; ``events`` mark the device copies that still read it."""
        if events:
            with self._lock:
                self._events[slot.data_ptr()] = tuple(events)
        self._free.put(slot)

    def drain(self) -> None:
        """Wait for every copy that still reads a slot."""
        with self._lock:
            pending, self._events = list(self._events.values()), {}
        for events in pending:
            for event in events:
                event.synchronize()

    def available(self) -> int:
        return self._free.qsize()
