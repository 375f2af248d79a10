"""Saves that failed validation, retried once on the thread that called ``save()``.

A retry starts only on that thread (its tracker sees only that thread's ops; another thread
cannot choose a consistent point for it), at its next gpusnap call. A wait on another
thread gives the retry up, failing the save at once, when the saving thread is not waiting
in gpusnap or has ended: a save never hangs on a retry nobody will start.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from gpusnap.errors import ValidationError
from gpusnap.handles import SaveCompletion
from gpusnap.save.job import SaveJob

__all__ = ["Retries"]

log = logging.getLogger("gpusnap")


class Retries:
    """``lock`` is the save path's (it also guards the pending saves)."""

    def __init__(self, lock: threading.RLock, enabled: bool) -> None:
        self._lock = lock
        self._enabled = enabled
        self._due: list[SaveJob] = []
        self._waiting: dict[threading.Thread, int] = {}  # threads inside a gpusnap wait

    def offer(self, job: SaveJob, error: ValidationError) -> bool:
        """Queue one retry of ``job`` (its offenders are now captured at save()); False when
        it gets none (retries off, already a retry, or its state let go)."""
        if not self._enabled or job.retry_note is not None or job.app_state is None:
            return False
        job.retry_note = str(error)
        job.flat = None  # type: ignore[assignment]  (the retry flattens again)
        log.warning("gpusnap: checkpoint %s will be retried: %s", job.completion.id, error)
        with self._lock:
            self._due.append(job)  # its pending stays listed: ck.wait() waits for the retry
            job.handed_on = True
        return True

    def take_mine(self) -> list[SaveJob]:
        """The retries due on the calling thread (they are its to start now)."""
        me = threading.current_thread()
        with self._lock:
            mine = [job for job in self._due if job.owner is me]
            self._due = [job for job in self._due if job.owner is not me]
        return mine

    def take_all(self) -> list[SaveJob]:
        with self._lock:
            late, self._due = self._due, []
        return late

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """The calling thread waits in gpusnap meanwhile (its due retries start there)."""
        me = threading.current_thread()
        with self._lock:
            self._waiting[me] = self._waiting.get(me, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._waiting[me] -= 1
                if not self._waiting[me]:
                    del self._waiting[me]

    def give_up(self, completion: SaveCompletion) -> tuple[SaveJob, str] | None:
        """The retry of ``completion``, taken off, when the calling thread cannot start it
        and its own thread will not (not waiting in gpusnap, or ended), with the error to
        fail it with; else None. Call it under the lock, with the pending save forgotten in
        the same hold."""
        me = threading.current_thread()
        job = next((j for j in self._due if j.completion is completion), None)
        if job is None or job.owner is me:
            return None
        owner = job.owner
        assert owner is not None
        if owner.is_alive() and self._waiting.get(owner):
            return None  # its wait starts the retry soon
        self._due.remove(job)
        state = "was not waiting in gpusnap" if owner.is_alive() else "had ended"
        return job, (f"{job.retry_note} (not retried: a retry starts only on the thread that called save(), "
                     f"{owner.name!r}, at its next gpusnap call, and that thread {state} when {me.name!r} "
                     "waited for it; wait for a save on the thread that made it to let a retry run)")
