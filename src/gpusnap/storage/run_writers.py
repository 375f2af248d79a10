"""A promotion's runs written by a few long-lived pool tasks, in order.

A promotion once handed its pool one future per run, all at once (509 of them for a 0.95B
Llama's training state). Each future brings about a dozen objects of Python's collector
with it: its condition, lock, waiters and the pool's work item. They stay alive for the
seconds of the promotion, so they reach the collector's oldest generation. In a probe on
CPU (600 tensors, BENCHMARKS.md, sixth section), they were ~7.8k of the ~12k objects a save
moved there. Each such object brings the next full collection of the program's heap nearer,
and a full collection holds the interpreter lock for ~0.2 s of a training loop.
Here ``workers`` tasks take the runs from one list, in order, as the pool's threads took
the futures, so the writes go out as before.

Call order: ``RunWriters(runs, store)`` -> :meth:`start` -> :meth:`group` for each group in
order -> :meth:`stop` (always: in a ``finally``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

__all__ = ["RunWriters"]


class RunWriters:
    """``runs``: the promotion's runs in order, each a group index and its chunk names;
    ``store`` writes one run and returns its durable names (it may raise)."""

    def __init__(self, runs: list[tuple[int, list[str]]], store: Callable[[list[str]], list[str]]) -> None:
        self._runs = runs
        self._store = store
        self._cond = threading.Condition()
        self._next = 0  # the next run to start
        self._names: list[list[str] | None] = [None] * len(runs)
        self._left: dict[int, int] = {}  # group -> runs not yet written
        self._first: dict[int, int] = {}  # group -> its first run's index
        for i, (k, _run) in enumerate(runs):
            self._left[k] = self._left.get(k, 0) + 1
            self._first.setdefault(k, i)
        self._error: BaseException | None = None
        self._stopped = False
        self._tasks: list[Future[None]] = []

    def start(self, pool: ThreadPoolExecutor, workers: int) -> None:
        """Start ``workers`` tasks on ``pool`` (at most one per run)."""
        for _ in range(max(1, min(workers, len(self._runs)))):
            self._tasks.append(pool.submit(self._work))

    def group(self, k: int) -> list[str]:
        """The durable names of group ``k``'s runs, in order, once all are written; the
        first error of any run is raised here (the promotion fails as a whole)."""
        with self._cond:
            while self._left.get(k, 0) and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            first = self._first.get(k)
            if first is None:
                return []
            out: list[str] = []
            i = first
            while i < len(self._runs) and self._runs[i][0] == k:
                out += self._names[i] or []
                i += 1
            return out

    def stop(self) -> None:
        """No run starts after this; returns once none is still being written. Never raises."""
        with self._cond:
            self._stopped = True
        wait(self._tasks)

    def _work(self) -> None:
        while True:
            with self._cond:
                if self._stopped or self._error is not None or self._next >= len(self._runs):
                    return
                i = self._next
                self._next += 1
            try:
                names = self._store(self._runs[i][1])
            except BaseException as exc:  # (raised to the promotion by group())
                with self._cond:
                    if self._error is None:
                        self._error = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self._names[i] = names
                self._left[self._runs[i][0]] -= 1
                self._cond.notify_all()
