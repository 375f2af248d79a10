"""The Checkpointer's promotion thread: fast-tier checkpoints copied to the durable root.

One promotion runs at a time and at most one waits behind it: a newer one due meanwhile
replaces the waiting one (which stays in the fast tier, reported in the newer one's
stats), so a durable root slower than the saves delays promotion but never queues memory
without bound. A failed promotion is logged, retried with the next one due, and if no later
promotion succeeds, raised (once) by the Checkpointer's next ``wait()`` or ``close()``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from gpusnap.errors import CheckpointError
from gpusnap.storage.fast_tier import FastTier
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.promote import pool_cpu_s, promote
from gpusnap.storage.repository import Repository
from gpusnap.thread_priority import lower_this_thread

__all__ = ["Promoter"]

log = logging.getLogger("gpusnap")


class Promoter:
    """Promotes from ``fast`` to the durable root ``durable()`` gives (opened on first use)."""

    def __init__(self, fast: FastTier, durable: Callable[[], Repository], *, threads: int,
                 on_promoted: Callable[[Repository, Manifest], None],
                 on_released: Callable[[], None] | None = None) -> None:
        self._fast = fast
        self._durable = durable
        self._on_promoted = on_promoted
        # after a promotion lets go of its fast checkpoint, before it counts as done: the fast
        # tier's retention, so that a save waiting for room (when_busy="wait") finds it
        self._on_released = on_released
        self._threads = threads
        self._cond = threading.Condition()
        self._waiting: Manifest | None = None
        self._running: Manifest | None = None
        self._superseded: list[str] = []
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.failure: BaseException | None = None  # the last promotion's, until one succeeds
        self.promoted = 0
        self.cpu_s = 0.0  # CPU time of the promotion threads, all promotions

    def submit(self, manifest: Manifest) -> None:
        """Promote ``manifest`` next (replacing one still waiting)."""
        with self._cond:
            if self._stopped:
                raise CheckpointError("the Checkpointer is closed: no promotion starts")
            if self._waiting is not None:
                self._superseded.append(self._waiting.id)
                self._fast.unpin_checkpoint(self._waiting.id)
            self._fast.pin_checkpoint(manifest.id)  # retention keeps it until it is promoted
            self._waiting = manifest
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="gpusnap-promoter", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def busy(self) -> bool:
        with self._cond:
            return self._waiting is not None or self._running is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until nothing is promoting or waiting; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._waiting is not None or self._running is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self) -> None:
        """Finish what is due, then end the thread."""
        self.wait()
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        lower_this_thread()  # (see thread_priority.py: the program's threads go first)
        pool = ThreadPoolExecutor(self._threads, thread_name_prefix="gpusnap-promote", initializer=lower_this_thread)
        try:
            while True:
                with self._cond:
                    while self._waiting is None and not self._stopped:
                        self._cond.wait()
                    if self._waiting is None:
                        return
                    manifest, self._waiting = self._waiting, None
                    self._running = manifest
                    superseded, self._superseded = self._superseded, []
                try:
                    self._promote(manifest, superseded, pool)
                finally:
                    self._fast.unpin_checkpoint(manifest.id)
                    self._released()
                    with self._cond:
                        self._running = None
                        self._cond.notify_all()
        finally:
            pool.shutdown(wait=True)

    def _released(self) -> None:
        if self._on_released is not None:
            try:
                self._on_released()
            except Exception as exc:  # (retention: the next commit tries again)
                log.warning("gpusnap: after a promotion: %s", exc)

    def _promote(self, manifest: Manifest, superseded: list[str], pool: ThreadPoolExecutor) -> None:
        cpu = time.thread_time()
        cpu_pool = pool_cpu_s(pool)
        try:
            durable = self._durable()
            extra = {"promoted_from": "fast", "promotions_skipped": superseded}
            promoted = promote(self._fast, manifest, durable, pool, extra_stats=extra)
        except Exception as exc:
            self.failure = exc
            log.warning("gpusnap: promotion of %s to the durable root failed; the next one due retries: %s",
                        manifest.id, exc)
            return
        finally:
            self.cpu_s += time.thread_time() - cpu + pool_cpu_s(pool) - cpu_pool
        self.failure = None
        self.promoted += 1
        try:
            self._on_promoted(durable, promoted)
        except Exception as exc:  # retention after the commit: the promotion stands
            log.warning("gpusnap: after promoting %s: %s", manifest.id, exc)
