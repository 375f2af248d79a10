"""Waiting on the store without holding a connection: poll a cheap check, backing off from
half a millisecond to 20 ms (what an answer costs in latency), bounded by a timeout and,
where a rank may have died, a probe every half second."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["poll"]

_MIN_S, _MAX_S, _PROBE_S = 0.0005, 0.02, 0.5


def poll(ready: Callable[[], bool], timeout_s: float, late: Callable[[], BaseException],
         probe: Callable[[], None] | None = None) -> None:
    """Return once ``ready()``; raise ``late()`` after ``timeout_s``. ``probe`` (which raises
    to end the wait) runs every half second."""
    now = time.monotonic()
    deadline, next_probe = now + timeout_s, now + _PROBE_S
    pause = _MIN_S
    idle = threading.Event()  # (never set: a pause the interpreter can be interrupted in)
    while not ready():
        now = time.monotonic()
        if probe is not None and now >= next_probe:
            next_probe = now + _PROBE_S
            probe()
        if now >= deadline:
            raise late()
        idle.wait(pause)
        pause = min(pause * 2, _MAX_S)
