"""A lazy restore whose loading is held until the program waits for it.

:func:`hold_loads` makes every restore's readers take nothing (after ``allow`` batches)
until something *waits* for the load: ``Schedule.wait`` (the gate, a door, ``restore()``
for what ``finish()`` reads), ``Schedule.wait_all`` (an opaque launch), ``Loader.join`` (an
eager restore, a save, a later restore) or ``RestoreHandle.wait``. Then the load runs to the
end. So a read that
does not wait sees the pre-restore bytes, whatever the scheduling, and one that does sees
the restored ones: no sleeps, no timing. ``Hold.waits`` names the wait that opened it.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

__all__ = ["HOLD_LIMIT", "Hold", "hold_loads", "snapshot"]

HOLD_LIMIT = 120.0  # a hang guard only: a reader held this long fails the load


class Hold:
    def __init__(self, allow: int) -> None:
        self.open = threading.Event()
        self.allow = allow  # batches taken before the hold applies ("mid-load")
        self.waits: list[str] = []  # what released it: "span", "all" or "join"
        self._lock = threading.Lock()

    def release(self, why: str) -> None:
        with self._lock:
            if not self.open.is_set():
                self.waits.append(why)
                self.open.set()

    def take(self) -> None:
        with self._lock:
            if self.allow > 0:
                self.allow -= 1
                return
        if not self.open.wait(HOLD_LIMIT):
            raise TimeoutError("restore_hold: the load was held and nothing ever waited for it")


def hold_loads(monkeypatch: pytest.MonkeyPatch, *, allow: int = 0) -> Hold:
    """Hold every restore's loading from now on (see the module docstring)."""
    from gpusnap.handles import RestoreHandle
    from gpusnap.restore.pipeline.loader import Loader
    from gpusnap.restore.pipeline.schedule import Schedule, SpanState

    hold = Hold(allow)
    take_batch, wait, wait_all, join = Schedule.take_batch, Schedule.wait, Schedule.wait_all, Loader.join
    handle_wait = RestoreHandle.wait

    def held_take_batch(self: Schedule, *args: Any, **kwargs: Any) -> Any:
        hold.take()
        return take_batch(self, *args, **kwargs)

    def releasing_wait(self: Schedule, ls: Any, *args: Any, **kwargs: Any) -> Any:
        if ls.state is not SpanState.LOADED:
            hold.release("span")
        return wait(self, ls, *args, **kwargs)

    def releasing_wait_all(self: Schedule, *args: Any, **kwargs: Any) -> Any:
        hold.release("all")
        return wait_all(self, *args, **kwargs)

    def releasing_join(self: Loader, timeout: float | None = None) -> bool:
        if timeout is None or timeout > 0:
            hold.release("join")
        return join(self, timeout)

    def releasing_handle_wait(self: RestoreHandle, *args: Any, **kwargs: Any) -> Any:
        hold.release("handle")
        return handle_wait(self, *args, **kwargs)

    monkeypatch.setattr(Schedule, "take_batch", held_take_batch)
    monkeypatch.setattr(Schedule, "wait", releasing_wait)
    monkeypatch.setattr(Schedule, "wait_all", releasing_wait_all)
    monkeypatch.setattr(Loader, "join", releasing_join)
    monkeypatch.setattr(RestoreHandle, "wait", releasing_handle_wait)
    return hold


def snapshot(t: torch.Tensor) -> torch.Tensor:
    """A copy of what ``t``'s memory holds right now, taken below every dispatch mode."""
    from torch.utils._mode_utils import no_dispatch

    with no_dispatch():
        return t.detach().clone()
