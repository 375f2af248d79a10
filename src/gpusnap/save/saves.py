"""The save path of one Checkpointer: ``save()``'s work on the caller's thread, the pending
saves, and the waits (which run the waiting thread's due retries).

A save flattens ``app_state``, picks its tier, then either opens a capture window (device
state, the fast tier, or any non-blocking save when ``Config.concurrent``) or copies the
state to the host at once (stop-the-world), and queues the job for the writer thread
(``engine.py``), which commits it (``commit.py``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from gpusnap.capture import CaptureCounters, snapshot_to_host
from gpusnap.capture.fast_arena import room_needed
from gpusnap.collector import collector_paused
from gpusnap.config import Config
from gpusnap.errors import CheckpointError, SaveSkipped, ValidationError
from gpusnap.handles import CheckpointInfo, PendingSave, SaveCompletion
from gpusnap.restore import active as lazy_restores
from gpusnap.save import progress
from gpusnap.save.commit import Committer
from gpusnap.save.engine import SaveEngine, stop_writer
from gpusnap.save.job import SaveJob, release_state
from gpusnap.save.planner import CapturePlanner
from gpusnap.save.retries import Retries
from gpusnap.save.tiers import Tiers
from gpusnap.save.unobserved import Unobserved
from gpusnap.save.windows import Windows
from gpusnap.state.flatten import FlatState, flatten
from gpusnap.storage.repository import Repository

if TYPE_CHECKING:
    from gpusnap.save.lifecycle import Lifecycle

__all__ = ["Saves"]

log = logging.getLogger("gpusnap")

RETRY_POLL_S = 0.05  # how often a waiting thread looks for a retry it must start


class Saves:
    """>>> saves = Saves(config, planner, tiers, allow_pickle=False)   # doctest: +SKIP
    >>> saves.save(app_state, None, blocking=False).wait()            # doctest: +SKIP
    """

    def __init__(self, config: Config, planner: CapturePlanner, tiers: Tiers, *, allow_pickle: bool) -> None:
        self.config = config
        self.tiers = tiers
        self.planner = planner
        self._allow_pickle = allow_pickle
        self.lock = threading.RLock()  # pending saves, windows, retries (re-entered by a SIGTERM handler)
        self._pending: list[SaveCompletion] = []
        self.io_pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="gpusnap-io")
        # one long-lived thread runs each window's copier in turn (one window at a time)
        self.copier_runner = ThreadPoolExecutor(1, thread_name_prefix="gpusnap-copier")
        self.windows = Windows(self.lock, planner, tiers, self.io_pool, self.copier_runner)
        self.retries = Retries(self.lock, config.retry_validation)
        self.engine = SaveEngine(self, max_pending=config.max_pending_saves, root=tiers.root)
        self._committer = Committer(config, planner.history, tiers, self.retries, self.io_pool,
                                    self.engine.on_writer_thread, weakref.ref(self))
        self.unobserved = Unobserved()  # failed saves whose error nothing has seen yet
        self.pid = os.getpid()
        # exit_hooks tracks this object (weakly): pending work keeps it alive (a job holds its
        # completion, which holds this; a promotion holds it too), so a Checkpointer dropped
        # with saves pending still has them finished at exit or on SIGTERM
        self.lifecycle: Lifecycle | None = None  # (set by the Checkpointer)
        weakref.finalize(self, _let_go, self.engine.jobs, tiers.opened).atexit = False

    # -- save -----------------------------------------------------------------------------
    def save(self, app_state: MutableMapping[str, Any], tag: str | None, blocking: bool, *,
             retry_of: SaveJob | None = None, promote: bool = False,
             coordinated: tuple[str, float] | None = None) -> PendingSave:
        """``coordinated``: a collective save's id and the seconds save() spent agreeing on it."""
        with collector_paused():  # not in this call's stall: see collector.py
            completion, run_now = self._save_now(app_state, tag, blocking, retry_of, promote, coordinated)
        if run_now is not None:
            with self.lock:  # listed while it runs: its tag is taken (pending_with_tag)
                self._pending.append(completion)
            try:
                self._committer.run(*run_now)  # (an interrupt there propagates: see Committer.run)
            finally:
                self.forget(completion)
        handle = PendingSave(completion)
        if blocking:
            handle.wait()
        return handle

    def _save_now(self, app_state: MutableMapping[str, Any], tag: str | None, blocking: bool,
                  retry_of: SaveJob | None, promote: bool, coordinated: tuple[str, float] | None,
                  ) -> tuple[SaveCompletion, tuple[Repository, SaveJob] | None]:
        """save()'s work on the caller's thread; a blocking save of host state returns its
        job to run right there (after the collector is back on)."""
        begun = time.perf_counter()
        started = begun - (coordinated[1] if coordinated is not None else 0.0)  # (the stall counts it)
        lazy_restores.before_save(app_state)  # any lazy restore in the process still loading: its bytes first
        self.reap()
        fast = self.tiers.fast() if self.tiers.saves_to_fast else None
        if fast is None:
            self.tiers.adopt_left()  # (a memory tier an earlier process left: its newest made durable)
        if fast is not None and self.config.when_busy == "skip" and retry_of is None and self.windows.any_open():
            return self._skip(tag, "the previous save is still copying"), None
        self.windows.wait_captured()  # one window at a time: counted in this save's stall
        self.reap()
        waited = time.perf_counter()
        # the previous save's plan: the per-tensor work is reused when nothing was re-laid out
        history = self.planner.history
        flat = flatten(app_state, allow_pickle=self._allow_pickle, plan=history.flat_plan)
        history.learn_plan(flat)
        flattened = time.perf_counter()
        if fast is not None and self.tiers.implicit and retry_of is None:
            piece = self.config.piece_bytes()
            need = room_needed([sp.nbytes for sp in flat.spans], piece)
            if not self.tiers.bound_fast(fast, need, max(1, min(piece, need))):
                fast = None  # (too little host memory: this and later saves go to the root)
                self.planner.history.forget_previous()
        repo = self.tiers.durable(create=True) if fast is None else fast
        created = time.time()
        if retry_of is not None:
            completion = retry_of.completion
        else:
            checkpoint_id = coordinated[0] if coordinated is not None else repo.new_id(created)
            completion = SaveCompletion(checkpoint_id, tag, self)
        job = SaveJob(completion, flat, created, started, blocking, CaptureCounters(progress=progress.callback()))
        job.app_state, job.owner = app_state, threading.current_thread()
        job.repo, job.promote = repo, promote
        if retry_of is not None:
            job.retry_note = retry_of.retry_note
            job.asked_at = retry_of.asked_at if retry_of.asked_at is not None else retry_of.created
            job.promote = retry_of.promote
            # its stats describe the save the caller made: a blocking caller has waited since
            # the first attempt (the retry itself runs inside that caller's wait)
            job.started, job.blocking = retry_of.started, retry_of.blocking
        job.phases.update(wait_previous=waited - begun, flatten=flattened - waited)
        if coordinated is not None:
            job.phases["coordinate"] = coordinated[1]
        # the fast tier is written by the copier only (a window, waited for when blocking)
        windowed = fast is not None or (self.config.concurrent and (not blocking or _blocking_via_window(flat)))
        if not windowed:
            job.host_spans, job.counters.bytes_copied, job.hashes = snapshot_to_host(
                flat, copy_cpu=not blocking, chunk_size=self.config.chunk_size
            )
        if blocking and not windowed:
            return completion, (repo, job)
        if windowed:
            job.concurrent = self.windows.open(repo, flat, completion, job.phases,
                                               lambda: self._others_busy(completion))
            if job.concurrent is None:  # when_busy="skip": the fast tier has no room now
                release_state(job)
                return self._skip(tag, "the fast tier has no room", completion), None
        else:
            completion.set_staged()
        queued = time.perf_counter()
        try:
            self._enqueue(job)
        except BaseException as exc:  # Ctrl-C while waiting for a slot, a close() meanwhile
            # a retry's error reaches no caller of save(): it stays unobserved until raised
            self.abandon(job, exc, raised=retry_of is None)
            raise
        job.stall_s = time.perf_counter() - started
        job.phases["queue"] = time.perf_counter() - queued
        return completion, None

    def _skip(self, tag: str | None, why: str, completion: SaveCompletion | None = None) -> SaveCompletion:
        """A save ``when_busy="skip"`` drops: its handle raises SaveSkipped from wait() only."""
        if completion is None:
            completion = SaveCompletion(self.tiers.fast().new_id(time.time()), tag)  # (nothing to wait for)
        log.warning("gpusnap: save %s skipped (Config.when_busy='skip'): %s", completion.id, why)
        completion.observe()  # reported here; the Checkpointer does not raise it later
        completion.fail(SaveSkipped(f"save {completion.id} was skipped: {why} (Config.when_busy='skip')"))
        return completion

    def _enqueue(self, job: SaveJob) -> None:
        with self.lock:
            if job.completion not in self._pending:
                self._pending.append(job.completion)
        behind_stop, others = self.engine.enqueue(job)
        for other in others:  # saves that raced close(), queued behind the writer's stop
            self.abandon(other, self.engine.closed_error(), raised=False)
        if behind_stop:
            raise self.engine.closed_error()

    def prepare(self, app_state: Mapping[str, Any] | None, nbytes: int | None, wait: bool) -> int:
        """Checkpointer.prepare's work (it checked the arguments)."""
        piece = self.config.piece_bytes()
        device_bytes = nbytes if nbytes is not None else 0
        if app_state is not None:
            history = self.planner.history
            flat = flatten(app_state, allow_pickle=self._allow_pickle, plan=history.flat_plan)
            history.learn_plan(flat)
            nbytes = room_needed([s.nbytes for s in flat.spans], piece)
            device_bytes = sum(s.nbytes for s in flat.spans if s.device.type == "cuda")
        assert nbytes is not None
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        fast = self.tiers.fast() if self.tiers.saves_to_fast else None
        piece_now = max(1, min(piece, nbytes))  # (no piece of a save is larger than the save)
        if fast is not None and not self.tiers.bound_fast(fast, nbytes, piece_now):  # (too little room: said here)
            fast = None  # (the memory tier is off now: the staging a save copies through, instead)
        if fast is not None:
            made = fast.prepare_for(self.tiers.fast_keep_last + 1, nbytes, piece_now)
            if wait:
                fast.wait_prepared()
        else:
            made = self.planner.reserve_staging(device_bytes)
        if wait:
            self.planner.join_warmup()
        return made

    # -- the writer's side ----------------------------------------------------------------
    def write_one(self, job: SaveJob) -> None:
        try:
            self._committer.run(job.repo if job.repo is not None else self.tiers.durable(create=True), job)
        except BaseException as exc:  # (run reports its own): the save must not hang
            self.abandon(job, exc, raised=False)
        finally:
            with self.lock:  # (a job handed on to its retry leaves it listed)
                if job.completion in self._pending and not job.handed_on:
                    self._pending.remove(job.completion)

    def abandon(self, job: SaveJob, error: BaseException, *, raised: bool) -> None:
        """Fail a save that started but will never reach (or left) the writer, and undo what
        it holds: its window closes (the copier stops, the program's ops stop waiting), its
        transaction is aborted once the copier and the writers are done (the root's shared
        lock, temporary files), and this thread's tracker is popped. ``raised``: the error
        propagates from save() itself, which counts as observing it."""
        capture = job.concurrent
        try:
            if capture is not None:
                capture.close_out(error)  # (a second interrupt while it waits stops the waiting)
        finally:  # whatever interrupts the undoing, the save is failed and forgotten: no hang
            self.forget(job.completion)
            release_state(job)
            if raised:
                job.completion.observe()  # (first: no other thread's wait() raises it too)
            job.completion.fail(error)
            self.reap(retry=False)

    def failed(self, completion: SaveCompletion) -> None:
        """A save failed (any path, any thread): recorded until observed; a collective one
        is reported to the other ranks, which must not wait for this rank's part."""
        self.unobserved.add(completion)
        collective = self.tiers.collective
        if collective is not None:
            collective.fail(completion.id, completion.error() or CheckpointError("failed"))

    # -- the pending saves ----------------------------------------------------------------
    def forget(self, completion: SaveCompletion) -> None:
        with self.lock:
            if completion in self._pending:
                self._pending.remove(completion)

    def pending(self) -> list[SaveCompletion]:
        with self.lock:
            return list(self._pending)

    def pending_named(self, ref: str) -> str | None:
        """The id of a save still pending whose id or tag is ``ref``."""
        with self.lock:
            return next((p.id for p in self._pending if ref in (p.id, p.tag) and not p.done()), None)

    def pending_with_tag(self, tag: str) -> str | None:
        with self.lock:
            return next((p.id for p in self._pending if p.tag == tag and not p.done()), None)

    def _others_busy(self, completion: SaveCompletion) -> bool:
        with self.lock:
            return any(p is not completion and not p.done() for p in self._pending)

    # -- waits ----------------------------------------------------------------------------
    def reap(self, *, retry: bool = True) -> None:
        """Pop closed windows' trackers on this thread; forget windows fully closed; start the
        retries of saves that failed validation on this thread. Any thread may call it."""
        self.windows.reap()
        if not retry:
            return
        for job in self.retries.take_mine():
            try:
                self.save(job.app_state, job.completion.tag, False, retry_of=job)
            except BaseException as exc:
                self.forget(job.completion)
                release_state(job)
                job.completion.fail(exc)
                if not isinstance(exc, Exception):
                    raise  # Ctrl-C during the retry's save(): this call is interrupted too

    def wait_for(self, completion: SaveCompletion, deadline: float | None) -> None:
        """Block until ``completion`` is done or ``deadline`` (time.monotonic) passes,
        running this thread's due retries meanwhile (``retries.py``)."""
        try:
            with self.retries.waiting():
                while True:
                    self.reap()
                    self._give_up_retry(completion)
                    if completion.done():
                        return
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return
                    completion.wait_done(RETRY_POLL_S if left is None else min(RETRY_POLL_S, left))
        finally:
            self.reap(retry=False)

    def _give_up_retry(self, completion: SaveCompletion) -> None:
        with self.lock:
            given_up = self.retries.give_up(completion)
            if given_up is None:
                return
            if completion in self._pending:
                self._pending.remove(completion)
        job, why = given_up
        release_state(job)
        completion.fail(ValidationError(why))

    def wait_all(self, timeout: float | None) -> list[CheckpointInfo]:
        """Checkpointer.wait()."""
        self.reap()
        pending = self.pending()
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in pending:
            self.wait_for(p, deadline)
        promoter = self.tiers.promoter
        if promoter is not None:
            promoter.retry_failed()  # (a promotion that failed gets one more try first)
        promoted = promoter is None or promoter.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self.unobserved.raise_if_any("Checkpointer.wait()")
        self.tiers.raise_promotion_failures()
        late = [p.id for p in pending if not p.done()]
        if late:
            raise TimeoutError(f"{len(late)} save(s) did not finish within {timeout} s: {', '.join(late)}")
        if not promoted:
            raise TimeoutError(f"a promotion to {self.tiers.root} did not finish within {timeout} s")
        return [info for p in pending if (info := p.info()) is not None]

    def fail_late_retries(self) -> None:
        """Close: each save that failed validation after the last chance to retry fails."""
        for job in self.retries.take_all():
            self.forget(job.completion)
            release_state(job)
            job.completion.fail(ValidationError(f"{job.retry_note} (not retried: the Checkpointer closed)"))

    def stop(self) -> None:
        """Stop the writer once it has written what is queued; release the threads."""
        for job in self.engine.close():
            self.abandon(job, self.engine.closed_error(), raised=False)

    def at_exit(self, final: bool) -> None:
        """Interpreter exit (exit_hooks.py): save/lifecycle.py's."""
        if self.lifecycle is not None:
            self.lifecycle.at_exit(final)

    def at_signal(self, deadline: float) -> None:
        """SIGTERM (exit_hooks.py): save/lifecycle.py's."""
        if self.lifecycle is not None:
            self.lifecycle.at_signal(deadline)

    def release_threads(self) -> None:
        self.copier_runner.shutdown(wait=True)
        self.io_pool.shutdown(wait=True)


def _blocking_via_window(flat: FlatState) -> bool:
    """Whether a blocking save takes the concurrent path and waits: for device state.

    Its copier copies device memory through pinned staging at the copy engine's rate, and
    its writers hash and store with the caller's thread idle, not holding the GIL. The
    stop-the-world path copies each tensor synchronously into fresh pageable memory, about
    twice torch.save's time for a large model. Host state keeps that path: it stores the
    caller's memory in place, without a copy."""
    return any(span.device.type != "cpu" for span in flat.spans)


def _let_go(jobs: Any, repos: list[Repository]) -> None:
    """A Checkpointer collected without close(): stop its writer, release its roots."""
    stop_writer(jobs)
    for repo in repos:
        repo.close()


