"""The commit protocol of one save, on the store (docs/distributed.md, "Commit protocol").

Each rank, on its writer thread, once its own part is durable (or has failed): ``report``.
Rank 0 then ``gather``s every part and decides (the caller writes the global manifest
between the two, :mod:`gpusnap.distributed.collective`) and ``publish``es the decision;
every other rank ``await``s it. Waits poll the store (a check is one message, never a
blocking wait that would hold a connection) and, every ``_PROBE_S``, ask
:class:`~gpusnap.distributed.liveness.Liveness` whether a rank waited for has died; each is
bounded by ``timeout_s``. Nothing here runs a collective of the program's process group.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from gpusnap.distributed.liveness import Liveness
from gpusnap.distributed.messages import Decision, Part, decision_key, part_key, parts_key
from gpusnap.distributed.poll import poll

__all__ = ["Missing", "Rounds"]

_FAILED = 1 << 20  # what a failed part adds to the counter: rank 0 sees it at once


class Missing(Exception):
    """A wait ended without its answer; ``ranks``: those that did not answer (a rank missed a
    save, or died: the ranks' saves may no longer correspond)."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class Rounds:
    def __init__(self, store: Any, waiter: Any, rank: int, size: int, liveness: Liveness, timeout_s: float) -> None:
        self._store = store  # short calls, any thread
        self._waiter = waiter  # polls, writer thread
        self.rank, self.size = rank, size
        self._liveness = liveness
        self.timeout_s = timeout_s
        self._reported: set[int] = set()
        self._lock = threading.Lock()

    def report(self, seq: int, part: Part) -> bool:
        """Tell rank 0 about this rank's part of save ``seq``, once (False: already told)."""
        with self._lock:
            if seq in self._reported:
                return False
            self._reported.add(seq)
        self._store.set(part_key(seq, self.rank), part.encode())
        self._store.add(parts_key(seq), _FAILED if part.error is not None else 1)
        return True

    def gather(self, seq: int) -> list[Part]:
        """Rank 0: every rank's part, or as soon as one failed, those reported so far.
        Raises :class:`Missing` when ranks did not report within the timeout or died."""
        count = 0

        def ready() -> bool:
            nonlocal count
            count = self._waiter.add(parts_key(seq), 0)
            return count >= self.size

        def waiting_for() -> list[int]:
            return [r for r in range(self.size) if not self._waiter.check([part_key(seq, r)])]

        self._poll(ready, waiting_for, "report its part")
        keys = [part_key(seq, r) for r in range(self.size)]
        present = [k for k in keys if self._waiter.check([k])] if count >= _FAILED else keys
        return [Part.decode(v) for v in self._waiter.multi_get(present)]

    def publish(self, seq: int, decision: Decision) -> None:
        self._store.set(decision_key(seq), decision.encode())

    def await_decision(self, seq: int) -> Decision:
        """Ranks but 0: rank 0's decision on save ``seq``. Rank 0 may itself wait up to the
        timeout for a slower rank, so this waits once more as long while rank 0's part is in."""
        key = decision_key(seq)

        def ready() -> bool:
            return bool(self._waiter.check([key]))

        try:
            self._poll(ready, lambda: [0], "decide")
        except Missing:
            if not self._waiter.check([part_key(seq, 0)]):
                raise
            self._poll(ready, lambda: [0], "decide")
        return Decision.decode(self._waiter.get(key))

    def forget(self, seq: int) -> None:
        """Drop this rank's keys of a decided save (rank 0: the counter and an old decision)."""
        self._store.delete_key(part_key(seq, self.rank))
        if self.rank == 0:
            self._store.delete_key(parts_key(seq))
            if seq >= 2:
                self._store.delete_key(decision_key(seq - 2))  # every writer has read it by now

    def _poll(self, ready: Callable[[], bool], waiting_for: Callable[[], list[int]], what: str) -> None:
        def probe() -> None:
            gone = self._liveness.gone(waiting_for())
            if gone:
                raise Missing(f"rank(s) {', '.join(map(str, gone))} ended (died or closed their Checkpointer) "
                              f"before they would {what}", gone)

        def late() -> Missing:
            missing = waiting_for()
            return Missing(f"rank(s) {', '.join(map(str, missing))} did not {what} within "
                           f"Config.collective_timeout_s={self.timeout_s:g} s (a rank that did not call save(), "
                           "or one much slower than the others)", missing)

        poll(ready, self.timeout_s, late, probe)
