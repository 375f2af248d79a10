"""Test hook: ``GPUSNAP_POOL_FAULT`` makes a pool process kill itself (SIGKILL) at a set
point, as a crash, the OOM killer or an operator would: ``die-starting@N`` while it starts
(after its model is built, before it says ready), ``die-loading@N`` once a take has arrived
and its weights have been written, before it says they are in place. ``garble-loading@N``
makes it say so in a ``loaded`` message the pool cannot read (its stats not a mapping, as a
process running another gpusnap version might send), then serve as if it had been read.
``N`` is the process's number in its pool (0: the first it started; a replacement gets the
next one), so a test can fail one process and watch the next. Several, comma-separated.

>>> Fault.parse("die-loading@0,die-starting@2").hits("loading", 0)
True
>>> Fault.parse("garble-loading@1").garbles(1)
True
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

__all__ = ["ENV", "Fault"]

ENV = "GPUSNAP_POOL_FAULT"
_POINTS = ("starting", "loading")


@dataclass(frozen=True)
class Fault:
    """Where processes die: ``(point, process number)`` pairs; which garble their ``loaded``."""

    points: frozenset[tuple[str, int]] = frozenset()
    garbled: frozenset[int] = frozenset()

    @classmethod
    def parse(cls, text: str) -> Fault:
        found, garbled = set(), set()
        for item in filter(None, (part.strip() for part in text.split(","))):
            what, _, seq = item.partition("@")
            point = what.removeprefix("die-")
            if what == "garble-loading" and seq.isdigit():
                garbled.add(int(seq))
                continue
            if not what.startswith("die-") or point not in _POINTS or not seq.isdigit():
                raise ValueError(f"{ENV}: {item!r} is not die-starting@N, die-loading@N or garble-loading@N")
            found.add((point, int(seq)))
        return cls(frozenset(found), frozenset(garbled))

    @classmethod
    def from_env(cls) -> Fault:
        return cls.parse(os.environ.get(ENV, ""))

    def hits(self, point: str, seq: int) -> bool:
        return (point, seq) in self.points

    def garbles(self, seq: int) -> bool:
        return seq in self.garbled

    def maybe_die(self, point: str, seq: int) -> None:
        if self.hits(point, seq):
            os.kill(os.getpid(), signal.SIGKILL)
