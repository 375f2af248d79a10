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
order -> :meth:`stop` (always: in a ``finally``). A run that fails stops the others from
starting; the runs in flight finish.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait

from gpusnap.errors import CheckpointError

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
        self._count: dict[int, int] = {}  # group -> its runs (they follow each other)
        for i, (k, _run) in enumerate(runs):
            self._left[k] = self._left.get(k, 0) + 1
            self._count[k] = self._count.get(k, 0) + 1
            self._first.setdefault(k, i)
        self._errors: dict[int, BaseException] = {}  # run index -> its error (no run starts after one)
        self._stopped = False
        self._tasks: list[Future[None]] = []

    def start(self, pool: ThreadPoolExecutor, workers: int) -> None:
        """Start ``workers`` tasks on ``pool`` (at most one per run, none without runs)."""
        for _ in range(min(max(1, workers), len(self._runs))):
            task = pool.submit(self._work)
            self._tasks.append(task)
            task.add_done_callback(self._task_done)

    def group(self, k: int) -> list[str]:
        """The durable names of group ``k``'s runs, in order, once all are written. Once a
        run has failed, no other starts: a group that can then not be written raises the
        failed run earliest in order (so a failure is raised in the order of the groups, as
        when each run was awaited in turn)."""
        with self._cond:
            while self._left.get(k, 0):
                if self._stopped or (self._errors and not self._will_finish(k)):
                    if not self._errors:
                        raise CheckpointError(f"group {k} of a promotion: its runs stopped before they were written")
                    raise self._errors[min(self._errors)]
                self._cond.wait()
            first = self._first.get(k, 0)
            out: list[str] = []
            for i in range(first, first + self._count.get(k, 0)):
                names = self._names[i]
                if names is None:  # (a written run always has its names)
                    raise CheckpointError(f"run {i} of a promotion has no names")
                out += names
            return out

    def _will_finish(self, k: int) -> bool:
        """Whether group ``k``'s runs are all written or being written (none failed): after a
        failure no run starts, but those in flight finish (the caller holds the lock)."""
        first, count = self._first[k], self._count[k]
        return first + count <= self._next and not any(first <= i < first + count for i in self._errors)

    def stop(self) -> None:
        """No run starts after this; returns once none is still being written. Never raises."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        for task in self._tasks:
            task.cancel()  # (one not started would take no run now)
        # (a cancelled task never runs; wait() would wait for it until its pool got to it,
        # forever for a pool that shut down with cancel_futures)
        wait([task for task in self._tasks if not task.cancelled()])

    def _task_done(self, task: Future[None]) -> None:
        # a task that never ran (cancelled, a broken pool) must not leave group() waiting
        error = CancelledError("a promotion's run writer was cancelled") if task.cancelled() else task.exception()
        if error is not None:
            with self._cond:
                if not self._stopped:
                    self._errors.setdefault(len(self._runs), error)  # (after every run's own error)
                self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                if self._stopped or self._errors or self._next >= len(self._runs):
                    return
                i = self._next
                self._next += 1
            try:
                names = self._store(self._runs[i][1])
            except BaseException as exc:  # (raised to the promotion by group())
                with self._cond:
                    self._errors[i] = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self._names[i] = names
                self._left[self._runs[i][0]] -= 1
                self._cond.notify_all()
