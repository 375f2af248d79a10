"""The writer thread and its queue: saves queued in order, at most ``max_pending_saves``.

The queue is unbounded, so that putting the writer's stop never blocks (``close()`` from a
signal handler that interrupted a save waiting for a slot); a save waits for a *slot*
instead. The thread holds its owner only while it writes a job: one the program drops
without ``close()`` (a notebook cell run again) is collected, and lets its root's writer
lease go, instead of holding it for the process's life.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Protocol

from gpusnap.errors import CheckpointError
from gpusnap.save.job import SaveJob

__all__ = ["JobWriter", "SaveEngine", "stop_writer"]

SIGNAL_CHECK_S = 0.2  # a save waiting for a slot looks for a signal (Ctrl-C) at least this often


class JobWriter(Protocol):
    def write_one(self, job: SaveJob) -> None:
        """Write and commit ``job`` (reporting on its handle; never raising)."""


class SaveEngine:
    def __init__(self, writer: JobWriter, *, max_pending: int, root: str) -> None:
        self._writer_ref = weakref.ref(writer)
        self.jobs: queue.Queue[SaveJob | None] = queue.Queue()
        self._slots = threading.BoundedSemaphore(max_pending)  # queued jobs at most
        self._thread: threading.Thread | None = None
        self._root = root
        self.closed = False  # refuses saves (set by close(), under _enqueue_lock)
        self._stop_sent = False  # the writer was told to stop
        # a save's last look at `closed` and its enqueue, against close(): a job is queued
        # before the writer's stop, or refused (never left behind it)
        self._enqueue_lock = threading.RLock()  # (a signal handler may close() inside a save())

    def closed_error(self) -> CheckpointError:
        return CheckpointError(f"Checkpointer({self._root!r}) was closed during this save()")

    def enqueue(self, job: SaveJob) -> tuple[bool, list[SaveJob]]:
        """Queue ``job`` for the writer; raises when a close() came first. Returns whether a
        close() meanwhile left ``job`` queued behind the writer's stop (never written), and
        the other jobs found there (saves that raced close()): the caller fails them all."""
        with self._enqueue_lock:
            if self.closed:  # by close() on another thread since this save's first check
                raise self.closed_error()
            self._ensure_writer()
        # Blocks while max_pending_saves durable writes are queued: not under the lock, which a
        # close() from a signal handler on this very thread (SIGTERM on preemption) takes. In
        # short waits: a signal (Ctrl-C) that lands just before a lock wait begins is handled
        # only when that wait ends (CPython), so an untimed wait would hold it until a slot frees.
        while not self._slots.acquire(timeout=SIGNAL_CHECK_S):
            pass
        try:
            self.jobs.put(job)
        except BaseException:
            self._slots.release()
            raise
        if not self._stop_sent:
            return False, []
        assert self._thread is not None
        self._thread.join()
        left = self.drain_stopped()
        return job in left, [j for j in left if j is not job]

    def drain_stopped(self) -> list[SaveJob]:
        """Once the writer has stopped: take the jobs queued after its stop."""
        left: list[SaveJob] = []
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return left
            if job is not None:
                self._slots.release()
                left.append(job)

    def close(self) -> list[SaveJob]:
        """Refuse new saves, let the writer write what is queued and stop; returns the jobs
        that raced the stop (the caller fails them). Each step may be repeated."""
        with self._enqueue_lock:
            self.closed = True
        if self._thread is None:
            return []
        if not self._stop_sent:
            self._ensure_writer()  # (what is queued is written even if it had ended)
            self._stop_sent = True  # (first: a save that queues after the stop sees it)
            self.jobs.put(None)
        self._thread.join()
        return self.drain_stopped()

    def on_writer_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _ensure_writer(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=_writer_loop, args=(self._writer_ref, self.jobs, self._slots),
                                            name="gpusnap-writer", daemon=True)
            self._thread.start()


def _writer_loop(ref: weakref.ref[JobWriter], jobs: queue.Queue[SaveJob | None],
                 slots: threading.BoundedSemaphore) -> None:
    while True:
        job = jobs.get()
        if job is not None:
            slots.release()  # taken off the queue: another save may queue
        owner = ref() if job is not None else None
        if owner is None:  # told to stop, or its owner is gone (its jobs with it)
            return
        owner.write_one(job)
        # neither is held while this thread waits for the next save: a finished job holds its
        # window's per-span records (~7k objects on GPT-2 large), which Python's full
        # collections would walk until then; the owner would never be collected
        del job, owner


def stop_writer(jobs: queue.Queue[SaveJob | None]) -> None:
    """The owner was collected without close(): stop its writer."""
    jobs.put_nowait(None)  # (unbounded)
