"""The Checkpointer's promotion thread: fast-tier checkpoints copied to the durable root.

Promotions run one at a time, oldest first. What waits is bounded by what was asked for:

* a promotion due by cadence (``promote_every``) waits only until a newer promotion is asked
  for, which replaces it (it stays in the fast tier, named in the newer one's stats), so a
  durable root slower than the saves delays promotion but never queues without bound;
* an explicit one (``save(promote=True)``) is never replaced: each is promoted in turn;
  so is one being tried again after a failure.

Every checkpoint asked to be promoted is pinned in its fast tier (retention keeps its slab
bytes) until it is promoted, called off (:meth:`Promoter.cancel`, for a delete), replaced,
or its failure has been raised to the program. A failed promotion is logged and tried again
once a later promotion succeeds (the durable root works again), and once more by the
Checkpointer's ``wait()``/``close()``; :meth:`Promoter.take_failures` hands the failures not
yet overcome to them, which raise them once. Pinned failures are bounded by the tier's room:
a save that finds no room otherwise lets the oldest go (:meth:`Promoter.let_go_oldest_failure`),
whose failure is then raised as a lost checkpoint.

Each promotion names the tier it reads: a fast root removed and made again is a new tier,
and promotions of the old one still read the old one's maps (its slab files, removed, live
on while mapped), which is closed once nothing of it waits (:meth:`Promoter.retire`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from gpusnap.config import Config
from gpusnap.errors import CheckpointError
from gpusnap.storage.fast_tier import FastTier
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.promote import CancelToken, pool_cpu_s, promote
from gpusnap.storage.promote_process import HelperUnavailable, PromotionProcess, process_usable
from gpusnap.storage.repository import Repository
from gpusnap.thread_priority import lower_this_thread

__all__ = ["Promoter"]

log = logging.getLogger("gpusnap")


@dataclass(frozen=True)
class _Job:
    tier: FastTier
    manifest: Manifest
    explicit: bool  # save(promote=True): never replaced
    retry: bool = False  # failed before: never replaced either (its failure is not raised yet)
    keep: object = field(default=None, compare=False)  # alive while this job is (the exit hooks' owner)


@dataclass(frozen=True)
class PromotionFailure:
    """A promotion that failed and has not succeeded since (its checkpoint stays pinned)."""

    checkpoint_id: str
    tag: str | None
    error: BaseException
    dropped: bool = False  # let go of to make room: no longer in the fast tier either


class Promoter:
    """Promotes fast-tier checkpoints to the durable root ``durable()`` gives (opened on first use)."""

    def __init__(self, durable: Callable[[], Repository], *, threads: int,
                 on_promoted: Callable[[Repository, Manifest], None],
                 on_released: Callable[[FastTier], None] | None = None, config: Config | None = None) -> None:
        self._durable = durable
        self._config = config if config is not None else Config()
        # the helper process promotions run in where Config.promotion_process asks for it
        # (storage/promote_process.py); None once it failed: this thread promotes from then on
        self._helper: PromotionProcess | None = PromotionProcess(self._config)
        self._on_promoted = on_promoted
        # after a promotion lets go of its fast checkpoint, before it counts as done: that
        # tier's retention, so that a save waiting for room (when_busy="wait") finds it
        self._on_released = on_released
        self._threads = threads
        self._cond = threading.Condition()
        self._queue: list[_Job] = []  # oldest first; at most one not explicit, the newest
        self._running: _Job | None = None
        self._token: CancelToken | None = None  # the running promotion's
        self._failed: dict[str, tuple[_Job, BaseException]] = {}
        self._dropped: list[PromotionFailure] = []  # failed, then let go of (not raised yet)
        self._superseded: list[str] = []
        self._retired: list[FastTier] = []  # replaced tiers, closed once nothing of theirs waits
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._stopped = False
        self.promoted = 0
        self.cpu_s = 0.0  # CPU time of the promotion threads, all promotions

    # -- asking ---------------------------------------------------------------------------
    def submit(self, tier: FastTier, manifest: Manifest, *, explicit: bool, keep: object = None) -> None:
        """Promote ``manifest`` (of ``tier``) after those queued; a waiting cadence promotion
        is replaced by it. ``keep`` stays alive while the promotion is queued, running or
        failed unraised."""
        with self._cond:
            if self._stopped:
                raise CheckpointError("the Checkpointer is closed: no promotion starts")
            tier.pin_checkpoint(manifest.id)  # retention keeps it until it is promoted
            for job in [j for j in self._queue if not j.explicit and not j.retry]:
                self._queue.remove(job)
                self._superseded.append(job.manifest.id)
                job.tier.unpin_checkpoint(job.manifest.id)
                log.info("gpusnap: promotion of %s replaced by the newer %s", job.manifest.id, manifest.id)
            self._queue.append(_Job(tier, manifest, explicit, keep=keep))
            self._start()
            self._cond.notify_all()

    def retry_failed(self) -> None:
        """Queue again every failed promotion not yet raised (``wait()`` gives them one more try)."""
        with self._cond:
            if self._failed and not self._stopped:
                self._requeue_failed()
                self._start()
                self._cond.notify_all()

    def _requeue_failed(self) -> None:
        """Failed promotions go first, oldest first (still pinned: each keeps its pin)."""
        retries = [dataclasses.replace(job, retry=True) for job, _exc in self._failed.values()]
        self._queue[0:0] = retries
        self._failed.clear()

    def cancel(self, ref: str) -> None:
        """Call off the promotion of checkpoint ``ref`` (an id or a tag; it is being deleted):
        dropped if waiting or failed; if running, it stops before its next run of chunks and
        never commits, unless it has committed already when this returns (then the durable
        copy is there for the caller to delete). Bytes it reads meanwhile that retention
        reuses fail its checks: it ends either way, and its failure is not raised."""

        def named(job: _Job) -> bool:
            return ref in (job.manifest.id, job.manifest.tag)

        with self._cond:
            for job in [j for j in self._queue if named(j)]:
                self._queue.remove(job)
                job.tier.unpin_checkpoint(job.manifest.id)
            for cid, (job, _exc) in list(self._failed.items()):
                if named(job):
                    del self._failed[cid]
                    job.tier.unpin_checkpoint(cid)
            self._dropped = [f for f in self._dropped if ref not in (f.checkpoint_id, f.tag)]
            if self._running is not None and named(self._running) and self._token is not None:
                # under the lock: the loop records a failure only if it was not called off
                # (the token waits for a commit in progress, which never takes this lock)
                self._token.cancel()
            self._cond.notify_all()
        self._close_retired()

    def let_go_oldest_failure(self) -> str | None:
        """Unpin the oldest failed promotion's checkpoint (a save needs its room); its failure
        is raised later as a lost checkpoint. Returns its id, or None when none is pinned."""
        with self._cond:
            if not self._failed:
                return None
            cid = next(iter(self._failed))
            job, exc = self._failed.pop(cid)
            self._dropped.append(PromotionFailure(cid, job.manifest.tag, exc, dropped=True))
        job.tier.unpin_checkpoint(cid)
        log.warning("gpusnap: checkpoint %s%s, whose promotion failed, is let go of in the fast tier to make room "
                    "for a save: it is in neither tier once retention drops it (wait() raises it): %s", cid,
                    f" (tag {job.manifest.tag!r})" if job.manifest.tag else "", exc)
        self._close_retired()
        return cid

    def retire(self, tier: FastTier) -> None:
        """``tier`` was replaced: close it once no promotion of it waits, runs or failed."""
        with self._cond:
            self._retired.append(tier)
        self._close_retired()

    # -- what it is doing ------------------------------------------------------------------
    def busy(self) -> bool:
        with self._cond:
            return bool(self._queue) or self._running is not None

    def pending_ids(self) -> list[str]:
        """The checkpoints waiting for or in promotion, oldest first."""
        with self._cond:
            jobs = ([self._running] if self._running is not None else []) + self._queue
            return [j.manifest.id for j in jobs]

    def failed_ids(self) -> list[str]:
        """The checkpoints whose promotion failed and is not raised yet (kept in their tier)."""
        with self._cond:
            return list(self._failed)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until nothing is promoting or waiting; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._running is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def take_failures(self) -> list[PromotionFailure]:
        """The failed promotions not overcome since (and those let go of), each handed out
        once; their checkpoints are unpinned (the program now knows: fast retention applies
        to them again)."""
        with self._cond:
            failed, self._failed = list(self._failed.values()), {}
            dropped, self._dropped = self._dropped, []
        for job, _exc in failed:
            job.tier.unpin_checkpoint(job.manifest.id)
        self._close_retired()
        return dropped + [PromotionFailure(j.manifest.id, j.manifest.tag, exc) for j, exc in failed]

    def stop(self) -> None:
        """Finish what is due, then end the thread."""
        self.wait()
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._cond:  # (nothing retries after this: a failed job's tier need not stay open)
            retired, self._retired = self._retired, []
        for tier in retired:
            tier.close()

    # -- the thread ------------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="gpusnap-promoter", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        lower_this_thread()  # (see thread_priority.py: the program's threads go first)
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._stopped:
                        self._cond.wait()
                    if not self._queue:
                        return
                    job = self._running = self._queue.pop(0)
                    token = self._token = CancelToken()
                    superseded, self._superseded = self._superseded, []
                failed: BaseException | None = None
                try:
                    failed = self._promote(job, superseded, token)
                finally:
                    with self._cond:
                        self._token = None
                        kept = failed is not None and not token.cancelled
                        if kept:
                            self._failed[job.manifest.id] = (job, failed)  # (stays pinned)
                        elif failed is None and not token.cancelled and self._failed:
                            self._requeue_failed()  # the durable root works again: try them now
                    if not kept:
                        job.tier.unpin_checkpoint(job.manifest.id)
                    self._released(job.tier)
                    with self._cond:
                        self._running = None
                        self._cond.notify_all()
                    try:
                        self._close_retired()
                    except BaseException as exc:  # (nothing may end this thread: wait() would hang)
                        log.warning("gpusnap: closing a replaced fast tier: %s", exc)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            if self._helper is not None:
                self._helper.close()

    def _released(self, tier: FastTier) -> None:
        if self._on_released is not None and tier not in self._retired:
            try:
                self._on_released(tier)
            except BaseException as exc:  # (retention: the next commit tries again)
                log.warning("gpusnap: after a promotion: %s", exc)

    def _close_retired(self) -> None:
        with self._cond:
            busy = {id(j.tier) for j in self._queue} | {id(j.tier) for j, _e in self._failed.values()}
            if self._running is not None:
                busy.add(id(self._running.tier))
            done = [t for t in self._retired if id(t) not in busy]
            self._retired = [t for t in self._retired if id(t) in busy]
        for tier in done:
            tier.close()

    def _pool_for_run(self) -> ThreadPoolExecutor | None:
        """The promotion threads, or None once the interpreter refuses new ones (at exit the
        promotion then runs on this thread alone)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="gpusnap-promote",
                                            initializer=lower_this_thread)
        try:
            self._pool.submit(lambda: None).result()
        except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
            return None
        return self._pool

    def _in_helper(self, job: _Job, durable: Repository, extra: dict[str, object],
                   token: CancelToken) -> Manifest | None:
        """The promotion run by the helper process, or None where this thread is to run it
        (not asked for, not a local root, a tier removed and made again, or the helper could
        not start, ended before committing or failed in a way of its own: then with a
        WARNING, and for good)."""
        helper = self._helper
        devices = [e.device for e in job.manifest.storages]
        if helper is None or not process_usable(self._config, job.tier, durable, devices) or not job.tier.intact():
            return None
        before = helper.cpu_s
        try:
            return helper.promote(job.tier, job.manifest, durable, extra_stats={**extra, "promoted_in": "helper"},
                                  cancel=token, workers=self._threads)
        except HelperUnavailable as exc:
            self._helper = None
            helper.close()
            log.warning("gpusnap: promotions run on the program's threads from now on (they take its interpreter "
                        "lock): %s", exc)
            return None
        finally:
            self.cpu_s += max(0.0, helper.cpu_s - before)

    def _promote(self, job: _Job, superseded: list[str], token: CancelToken) -> BaseException | None:
        """One promotion; returns its error (logged), or None once committed (or called off)."""
        manifest = job.manifest
        pool = self._pool_for_run()
        cpu = time.thread_time()
        cpu_pool = pool_cpu_s(pool)
        try:
            durable = self._durable()
            extra: dict[str, object] = {"promoted_from": "fast", "promotions_skipped": superseded}
            promoted = self._in_helper(job, durable, extra, token)
            if promoted is None:
                extra["promoted_in"] = "threads"
                promoted = promote(job.tier, manifest, durable, pool, extra_stats=extra, cancel=token,
                                   workers=self._threads)
        except BaseException as exc:  # (a SystemExit from a backend too: it would end this thread,
            # and every later promotion would wait for it forever; kept and raised by wait() instead)
            if token.cancelled:  # (called off: whatever it met after that is no failure)
                log.info("gpusnap: the promotion of %s was called off (%s)", manifest.id, exc)
                return None
            log.warning("gpusnap: promotion of %s to the durable root failed; it stays in the fast tier and is "
                        "tried again before the next one (and by wait()): %s", manifest.id, exc)
            return exc
        finally:
            self.cpu_s += time.thread_time() - cpu + pool_cpu_s(pool) - cpu_pool
        self.promoted += 1
        try:
            self._on_promoted(durable, promoted)
        except BaseException as exc:  # retention after the commit: the promotion stands (and the thread)
            log.warning("gpusnap: after promoting %s: %s", manifest.id, exc)
        return None
