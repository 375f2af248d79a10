"""The ``Checkpointer``: orchestrates state -> capture -> storage on save, and back on restore.

Save, in call order (each step raises before the next starts):
  1. ``flatten(app_state)``: plain values encoded now, tensors grouped by storage.
  2. capture: every span's bytes on the host at the consistent point (the call of ``save``).
  3. background writer: chunks hashed and stored, manifest committed, retention applied.
Restore: resolve -> plan (all checks, nothing written) -> read, verify and apply in place
(``restore.Restorer``: verify-first, pipelined, or lazy behind a dispatch-mode gate).
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from gpusnap import exit_hooks
from gpusnap.capture import CaptureCounters, snapshot_to_host, write_host_spans
from gpusnap.capture.concurrent import ConcurrentSave
from gpusnap.capture.fast_arena import FastArena, room_needed
from gpusnap.capture.staging import StagingArena
from gpusnap.capture.trace import Trace
from gpusnap.capture.history import SKIP_WORTH, CaptureHistory
from gpusnap.capture.options import CaptureOptions
from gpusnap.capture.warmup import WARMUP_JOIN_S, start_capture_warmup
from gpusnap.collector import collector_paused
from gpusnap.config import Config
from gpusnap.device import outside_graph_captures
from gpusnap.distributed.collective import Collective
from gpusnap.distributed.group import collective_group
from gpusnap.distributed.restore import collective_restore
from gpusnap.restore.rank_view import rank_view
from gpusnap.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    SaveSkipped,
    StorageError,
    ValidationError,
)
from gpusnap.handles import CheckpointInfo, PendingSave, RestoreHandle
from gpusnap.promotion import Promoter
from gpusnap.restore import active as lazy_restores
from gpusnap.restore.restorer import Restorer, Verify
from gpusnap.state.flatten import FlatState, flatten
from gpusnap.storage.fast_tier import FastTier
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.repository import Repository
from gpusnap.unobserved import Unobserved

__all__ = ["Checkpointer", "info_from_manifest"]

log = logging.getLogger("gpusnap")

_RETRY_POLL_S = 0.05  # how often a waiting thread looks for a retry it must start


def info_from_manifest(manifest: Manifest, tier: str = "durable") -> CheckpointInfo:
    return CheckpointInfo(
        id=manifest.id,
        tag=manifest.tag,
        created=manifest.created,
        nbytes=manifest.nbytes,
        stats=dict(manifest.stats),
        tier=tier,
        world_size=manifest.world_size,
    )


@dataclass
class _SaveJob:
    pending: PendingSave
    flat: FlatState
    created: float
    started: float
    blocking: bool
    counters: CaptureCounters
    host_spans: list[torch.Tensor] = field(default_factory=list)  # stop-the-world path
    hashes: list[list[str] | None] = field(default_factory=list)  # device hashes (stop-the-world)
    concurrent: ConcurrentSave | None = None  # concurrent path (it opens its own txn)
    stall_s: float = 0.0  # a blocking save's stall is the whole save
    phases: dict[str, float] = field(default_factory=dict)  # where save() spent its time
    app_state: Any = None  # kept for one retry after a validation failure
    owner: threading.Thread | None = None  # called save(): a retry starts on this thread only
    retry_note: str | None = None  # why this save is a retry
    asked_at: float | None = None  # a retry: when save() was called (its state is from later)
    handed_on: bool = False  # failed validation: its retry (another job) finishes its pending
    repo: Repository | None = None  # where it commits: the root, or the fast tier
    promote: bool = False  # fast tier: promote it whatever the count


def _release_state(job: _SaveJob) -> None:
    """Drop a finished save's references to the program's state (its mapping, storages and
    tensors), on the writer thread *before* the save is reported done: other holders of the
    job's records (the writer's frame until it returns, the copier's last window) then keep
    no memory of the program alive once ``wait()`` returns."""
    job.app_state = None
    if job.flat is not None:
        for span in job.flat.spans:
            span.release()


class Checkpointer:
    """Checkpoints and restores an ``app_state`` mapping under ``root``.

    ``root`` is a local directory (created on first save) or an fsspec URL such as
    ``memory://ckpt`` or ``s3://bucket/run`` (``storage_options`` go to fsspec).

    >>> import torch, gpusnap
    >>> model = torch.nn.Linear(4, 2)
    >>> app_state = {"model": model, "step": 3}
    >>> with gpusnap.Checkpointer("memory://doctest-ckpt", keep_last=2) as ckpt:
    ...     info = ckpt.save(app_state, tag="first").wait()
    ...     app_state["step"] = 4
    ...     _ = ckpt.restore(app_state)
    >>> app_state["step"]
    3

    With ``fast_root`` (a local path in host memory, such as ``/dev/shm/run1``) saves commit
    to a *fast tier* there (no host copy or hash: docs/tiers.md), which survives the process
    but not the machine; every ``promote_every``-th committed save (and any saved with
    ``promote=True``) is then copied in the background to ``root``, the durable tier.
    ``fast_keep_last`` (default 2) is the fast tier's retention, ``keep_last`` the root's.
    ``list()``, ``latest()`` and ``restore()`` consider both tiers.

    When ``torch.distributed`` is initialized, the Checkpointer is *collective* over
    ``process_group`` (default: the world; ``False``: per process): every rank calls
    ``save()`` at the same step and ``restore()`` together, and a checkpoint is listed once
    every rank's part is durable (docs/distributed.md).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        config: Config | None = None,
        allow_pickle: bool = False,
        storage_options: dict[str, Any] | None = None,
        fast_root: str | os.PathLike[str] | None = None,
        fast_keep_last: int | None = None,
        promote_every: int | None = None,
        process_group: Any = None,
    ) -> None:
        for name, value in (("keep_last", keep_last), ("fast_keep_last", fast_keep_last), ("promote_every", promote_every)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if fast_root is None and (fast_keep_last is not None or promote_every is not None):
            raise ValueError("fast_keep_last and promote_every need a fast_root")
        self.fast_root = None if fast_root is None else os.fspath(fast_root)
        self.fast_keep_last = fast_keep_last if fast_keep_last is not None else 2
        self.promote_every = promote_every
        self._fast: FastTier | None = None
        self._promoter: Promoter | None = None
        self._fast_commits = 0  # committed to the fast tier (promote_every counts these)
        self._save_progress: Callable[[int], None] | None = None  # gpusnap.import_'s, told bytes stored
        self._skipped = 0  # saves skipped (when_busy="skip")
        self.root = os.fspath(root)
        self.keep_last = keep_last
        self.config = config if config is not None else Config.from_env()
        if self.fast_root is not None:
            if self.config.fast_slab_bytes <= self.config.piece_bytes():
                raise ValueError(f"Config.fast_slab_bytes ({self.config.fast_slab_bytes}) must be larger than one "
                                 f"copy piece ({self.config.piece_bytes()} bytes)")
            if os.path.abspath(self.fast_root) == os.path.abspath(self.root):
                raise ValueError("fast_root must be a directory of its own, not the Checkpointer's root")
        self.allow_pickle = allow_pickle
        self._storage_options = storage_options
        group = collective_group(process_group)
        self._collective = None if group is None else Collective(self.root, group, self.config, storage_options)
        if self._collective is not None and self.fast_root is not None:
            raise ValueError("a collective Checkpointer has no fast tier yet: leave out fast_root, or pass "
                             "process_group=False for per-process checkpoints")
        self._repo: Repository | None = None
        self._repo_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self.config.io_threads, thread_name_prefix="gpusnap-io")
        # one long-lived thread runs each window's copier in turn (one window at a time)
        self._copier_runner = ThreadPoolExecutor(1, thread_name_prefix="gpusnap-copier")
        # jobs for the writer; unbounded, so that putting its stop never blocks (close() from a
        # signal handler that interrupted a save waiting for a slot); saves wait for a slot
        self._queue: queue.Queue[_SaveJob | None] = queue.Queue()
        self._slots = threading.BoundedSemaphore(self.config.max_pending_saves)  # queued jobs at most
        self._pending: list[PendingSave] = []
        self._pending_lock = threading.RLock()  # (re-entered by a SIGTERM handler: _at_signal)
        self._writer: threading.Thread | None = None
        self._windows: list[ConcurrentSave] = []
        # what saves learn from each other: plans, orders, hashes (capture/history.py)
        self._history = CaptureHistory(self.config.chunk_size)
        self._retries: list[_SaveJob] = []  # failed validation; retried at the owner's next call
        self._staging: StagingArena | None = None
        self._streams: dict[torch.device, Any] = {}
        self._restorer = Restorer(
            io_threads=self.config.io_threads,
            staging_bytes=self.config.staging_bytes,
            piece_bytes=self.config.restore_piece_bytes,
            verify_on_device={"auto": None, "on": True, "off": False}[self.config.restore_verify_on_device],
            scratch_slots=self.config.restore_scratch_slots,
            device_check_min_bytes=self.config.device_check_min_bytes,
            reader_processes=self.config.restore_reader_processes,
            direct_copies=self.config.restore_direct_copies,
            from_server=self.config.restore_from_server,
            server_socket=self.config.restore_server_socket,
        )
        self._closed = False  # refuses saves (set by close(), under _enqueue_lock)
        self._stopped = False  # close() has finished: threads released
        self._stop_sent = False  # the writer was told to stop
        self._close_lock = threading.Lock()  # a second close() waits for the first
        # a save's last look at _closed and its enqueue, against close(): a job is queued
        # before the writer's stop, or refused (never left behind it)
        self._enqueue_lock = threading.RLock()  # (a signal handler may close() inside a save())
        self._unobserved = Unobserved()  # failed saves whose error nothing has seen yet
        # threads inside a gpusnap wait, which runs their due retries (see _wait_for)
        self._waiting: dict[threading.Thread, int] = {}
        # the save kernels load beside the program's set-up, not in the first save()
        self._warmup = (start_capture_warmup(self.config.chunk_size, self._copy_stream)
                        if self.config.concurrent and self.config.warm_up_kernels else None)
        self._pid = os.getpid()
        exit_hooks.track(self, sigterm_grace_s=self.config.sigterm_grace_s)
        self._opened: list[Repository] = []  # (for _let_go, which must not hold self)
        weakref.finalize(self, _let_go, self._queue, self._opened).atexit = False

    # -- repository ---------------------------------------------------------------------------
    def _repository(self, *, create: bool) -> Repository:
        """The root; ``create`` (saving) also makes this Checkpointer its one writer until
        ``close()``: a StorageError names the writer that already holds it."""
        with self._repo_lock:
            if self._repo is None and self._collective is not None:  # (this rank's own root)
                self._repo = repo = self._collective.rank_repository()
                self._opened.append(repo)
            if self._repo is None:
                self._repo = repo = Repository.open(
                    self.root,
                    create=create,
                    storage_options=self._storage_options,
                    config=self.config,
                )
                self._opened.append(repo)
            if create and isinstance(self._repo, FastTier):  # (reading one is fine)
                raise CheckpointError(
                    f"{self.root} is a fast tier's root; a Checkpointer's root is durable: give it its own directory "
                    "(and pass the fast tier as fast_root)"
                )
            if create:
                self._repo.claim_writer()  # idempotent
                if self._collective is not None:
                    self._collective.announce()
            return self._repo

    def _fast_tier(self) -> FastTier:
        """The fast tier (created on first use), with this Checkpointer its one writer."""
        with self._repo_lock:
            if self._fast is not None and not self._fast.intact():
                # removed under us (a cleaned /dev/shm): start a new one there; the old one's
                # lease and maps go (saves still holding its transactions fail on their own)
                log.warning("gpusnap: the fast tier %s was removed; a new one is made there", self.fast_root)
                self._opened.remove(self._fast)
                if self._promoter is not None:  # its promotions still read the old tier's maps
                    self._promoter.retire(self._fast)
                else:
                    self._fast.close()
                self._fast = None
            if self._fast is None:
                assert self.fast_root is not None
                self._fast = FastTier.open(self.fast_root, create=True, config=self.config,
                                           durable_root=self._durable_identity())
                self._opened.append(self._fast)
                self._history.forget_previous()  # (its chunk names pointed into the old tier)
            self._fast.claim_writer()
            return self._fast

    def _fast_saves_held(self) -> int:
        """Checkpoints the fast tier has room for: those kept, the one being written, and one
        more (a promotion in flight holds one past retention; room lost between regions)."""
        return self.fast_keep_last + 2

    def _durable_identity(self) -> str:
        """How a fast root records the durable root it belongs to (a local one by its real path)."""
        local = self.root.removeprefix("file://")
        return self.root if "://" in local else os.path.realpath(local)

    def _promoter_for(self) -> Promoter:
        if self._promoter is None:
            self._promoter = Promoter(lambda: self._repository(create=True), threads=self.config.io_threads,
                                      on_promoted=lambda repo, _m: self._retain(repo, self.keep_last),
                                      on_released=lambda tier: self._retain(tier, self.fast_keep_last))
        return self._promoter

    # -- save ---------------------------------------------------------------------------------
    def save(
        self, app_state: MutableMapping[str, Any], *, tag: str | None = None, blocking: bool = False,
        promote: bool = False,
    ) -> PendingSave:
        """Checkpoint ``app_state`` as it is now; returns at once unless ``blocking``.

        The checkpoint equals the state at this call (work already enqueued on the current
        CUDA stream counts as before it). ``pending.wait()`` returns the committed
        :class:`CheckpointInfo` or raises the error that stopped the save.

        An earlier save's failure is not raised here (this save may well succeed): the next
        :meth:`wait`, :meth:`close` or ``with``-block exit raises it (see :class:`PendingSave`).

        With a ``fast_root`` the save commits to the fast tier; ``promote=True`` also copies
        it to the durable root afterwards, whatever ``promote_every`` says.
        """
        self._check_open()
        if self._collective is None:
            return self._checked_save(app_state, tag, blocking, promote, None)
        agreeing = time.perf_counter()
        _seq, checkpoint_id = self._collective.next_save()  # the same id on every rank: no message
        coordinated = (checkpoint_id, time.perf_counter() - agreeing)
        try:
            return self._checked_save(app_state, tag, blocking, promote, coordinated)
        except BaseException as exc:  # the other ranks must not wait for this rank's part
            self._collective.fail(checkpoint_id, exc)
            raise

    def _checked_save(self, app_state: MutableMapping[str, Any], tag: str | None, blocking: bool, promote: bool,
                      coordinated: tuple[str, float] | None) -> PendingSave:
        """``coordinated``: a collective save's id and the seconds save() spent agreeing on it."""
        if tag is not None and (not isinstance(tag, str) or not tag or "/" in tag):
            raise ValueError(f"tag must be a non-empty string without '/', got {tag!r}")
        if promote and self.fast_root is None:
            raise ValueError("promote=True needs a fast_root (without one every save is durable)")
        if tag is not None:
            started = time.perf_counter()
            self._check_tag_free(tag)
            if coordinated is not None:  # (tags of collective saves live in the global manifests)
                coordinated = (coordinated[0], coordinated[1] + time.perf_counter() - started)
        return self._save(app_state, tag, blocking, promote=promote, coordinated=coordinated)

    def prepare(
        self, app_state: Mapping[str, Any] | None = None, *, nbytes: int | None = None, wait: bool = False
    ) -> int:
        """Make ready now what the first :meth:`save` would otherwise make while it runs;
        returns the bytes of memory set aside. Optional: call it during set-up, once the
        state exists at its full size (an optimizer's state appears at its first step, so
        after that step, or pass ``nbytes``).

        With a ``fast_root`` it sets aside page-locked slabs for ``fast_keep_last + 1``
        checkpoints of ``app_state``'s size (or of ``nbytes``) and makes them on a background
        thread at the lowest priority (``wait=True`` returns once they are made); without
        one it grows the pinned staging a save of CUDA state copies through, on this thread.
        Either way, ``wait=True`` also waits for the save kernels to load. Making the memory
        costs the program ~70 ms per GiB whenever it happens: here, rather than
        in the first checkpoint's window.

        >>> ckpt = gpusnap.Checkpointer("runs/x", fast_root="/dev/shm/x")  # doctest: +SKIP
        >>> train_one_step(); ckpt.prepare(app_state, wait=True)            # doctest: +SKIP
        """
        self._check_open()
        if (app_state is None) == (nbytes is None):
            raise ValueError("prepare() takes app_state or nbytes (one of them)")
        piece = self.config.piece_bytes()
        device_bytes = nbytes if nbytes is not None else 0
        if app_state is not None:
            flat = flatten(app_state, allow_pickle=self.allow_pickle, plan=self._history.flat_plan)
            self._history.learn_plan(flat)
            spans = [s.nbytes for s in flat.spans]
            nbytes = room_needed(spans, piece)
            device_bytes = sum(s.nbytes for s in flat.spans if s.device.type == "cuda")
        assert nbytes is not None
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if self.fast_root is not None:
            piece = max(1, min(piece, nbytes))  # (no piece of a save is larger than the save)
            fast = self._fast_tier()
            fast.set_budget(self._fast_saves_held(), nbytes, piece)  # (too little room: said here)
            made = fast.prepare_for(self.fast_keep_last + 1, nbytes, piece)
            if wait:
                fast.wait_prepared()
        else:
            made = 0
            if device_bytes and torch.cuda.is_available():
                arena = self._staging_arena(pinned=True)
                with torch.inference_mode(False):
                    arena.reserve(device_bytes + piece)
                made = arena.nbytes
        if wait and self._warmup is not None:
            self._warmup.join(WARMUP_JOIN_S)
        return made

    def _check_tag_free(self, tag: str) -> None:
        """A tag names one checkpoint: refuse one that a committed checkpoint or a save still
        pending here carries (the commit checks again, under the writer lease)."""
        with self._pending_lock:
            pending = next((p.id for p in self._pending if p.tag == tag and not p.done()), None)
        if pending is not None:
            raise CheckpointError(
                f"tag {tag!r} is taken by checkpoint {pending}, still being saved; a tag names one "
                "checkpoint: pick another tag"
            )
        if self._collective is not None:
            owner = self._collective.tag_owner(tag)
        else:
            owner = self._repository(create=True).tag_owner(tag)
        if owner is None and self.fast_root is not None:
            owner = self._fast_tier().tag_owner(tag)
        if owner is not None:
            raise CheckpointError(
                f"tag {tag!r} already names checkpoint {owner} in {self.root}; a tag names one "
                "checkpoint: pick another tag"
            )

    def _save(
        self,
        app_state: MutableMapping[str, Any],
        tag: str | None,
        blocking: bool,
        retry_of: _SaveJob | None = None,
        promote: bool = False,
        coordinated: tuple[str, float] | None = None,
    ) -> PendingSave:
        with collector_paused():  # not in this call's stall: see collector.py
            pending, run_now = self._save_now(app_state, tag, blocking, retry_of, promote, coordinated)
        if run_now is not None:
            with self._pending_lock:  # listed while it runs: its tag is taken (_check_tag_free)
                self._pending.append(pending)
            try:
                self._run_job(*run_now)  # (an interrupt there propagates: see _run_job)
            finally:
                self._forget(pending)
        if blocking:
            pending.wait()
        return pending

    def _save_now(
        self,
        app_state: MutableMapping[str, Any],
        tag: str | None,
        blocking: bool,
        retry_of: _SaveJob | None,
        promote: bool = False,
        coordinated: tuple[str, float] | None = None,
    ) -> tuple[PendingSave, tuple[Repository, _SaveJob] | None]:
        """save()'s work on the caller's thread; a blocking save of host state returns its
        job to run right there (after the collector is back on)."""
        begun = time.perf_counter()
        started = begun - (coordinated[1] if coordinated is not None else 0.0)  # (the stall counts it)
        lazy_restores.before_save(app_state)  # any lazy restore in the process still loading: its bytes first
        self._reap()
        fast = self._fast_tier() if self.fast_root is not None else None
        if fast is not None and self.config.when_busy == "skip" and retry_of is None and self._window_open():
            return self._skip(tag, "the previous save is still copying"), None
        self._wait_for_open_window()  # one window at a time: counted in this save's stall
        waited = time.perf_counter()
        # the previous save's plan: the per-tensor work is reused when nothing was re-laid out
        flat = flatten(app_state, allow_pickle=self.allow_pickle, plan=self._history.flat_plan)
        self._history.learn_plan(flat)
        flattened = time.perf_counter()
        repo = self._repository(create=True) if fast is None else fast
        created = time.time()
        if retry_of is not None:
            pending = retry_of.pending
        else:
            pending = PendingSave(coordinated[0] if coordinated is not None else repo.new_id(created), tag)
        pending._on_wait, pending._waits, pending._on_fail = self._reap, self._wait_for, self._failed
        job = _SaveJob(pending, flat, created, started, blocking, CaptureCounters(progress=self._save_progress))
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
        windowed = fast is not None or (self.config.concurrent and (not blocking or self._blocking_via_window(flat)))
        if not windowed:
            job.host_spans, job.counters.bytes_copied, job.hashes = snapshot_to_host(
                flat, copy_cpu=not blocking, chunk_size=self.config.chunk_size
            )
        if blocking and not windowed:
            return pending, (repo, job)
        if windowed:
            job.concurrent = self._start_window(repo, flat, pending, job.phases)
            if job.concurrent is None:  # when_busy="skip": the fast tier has no room now
                _release_state(job)
                return self._skip(tag, "the fast tier has no room", pending), None
        else:
            pending._set_staged()
        queued = time.perf_counter()
        try:
            self._enqueue(job)
        except BaseException as exc:  # Ctrl-C while waiting for a slot, a close() meanwhile
            # a retry's error reaches no caller of save(): it stays unobserved until raised
            self._abandon(job, exc, raised=retry_of is None)
            raise
        job.stall_s = time.perf_counter() - started
        job.phases["queue"] = time.perf_counter() - queued
        return pending, None

    def _failed(self, pending: PendingSave) -> None:
        """A save failed (any path, any thread): recorded until observed; a collective one
        is reported to the other ranks, which must not wait for this rank's part."""
        self._unobserved.add(pending)
        if self._collective is not None:
            self._collective.fail(pending.id, pending._durable.error() or CheckpointError("failed"))

    def _window_open(self) -> bool:
        with self._pending_lock:
            return any(not c.window.closed for c in self._windows)

    def _skip(self, tag: str | None, why: str, pending: PendingSave | None = None) -> PendingSave:
        """A save ``when_busy="skip"`` drops: its handle raises SaveSkipped from wait() only."""
        self._skipped += 1
        if pending is None:
            pending = PendingSave(self._fast_tier().new_id(time.time()), tag)
        log.warning("gpusnap: save %s skipped (Config.when_busy='skip'): %s", pending.id, why)
        pending._mark_observed()  # reported here; the Checkpointer does not raise it later
        pending._fail(SaveSkipped(f"save {pending.id} was skipped: {why} (Config.when_busy='skip')"))
        return pending

    def _enqueue(self, job: _SaveJob) -> None:
        with self._pending_lock:
            if job.pending not in self._pending:
                self._pending.append(job.pending)
        with self._enqueue_lock:
            if self._closed:  # by close() on another thread since this save's first check
                raise CheckpointError(f"Checkpointer({self.root!r}) was closed during this save()")
            self._ensure_writer()
        # Blocks while max_pending_saves durable writes are queued: not under the lock, which a
        # close() from a signal handler on this very thread (SIGTERM on preemption) takes.
        self._slots.acquire()
        try:
            self._queue.put(job)
        except BaseException:
            self._slots.release()
            raise
        if self._stop_sent:  # a close() meanwhile: was this job queued behind the writer's stop?
            self._writer.join()  # type: ignore[union-attr]
            if job in self._drain_stopped(keep=job):
                raise CheckpointError(f"Checkpointer({self.root!r}) was closed during this save()")

    def _drain_stopped(self, keep: _SaveJob | None = None) -> list[_SaveJob]:
        """Once the writer has stopped: take the jobs queued after its stop (saves that raced
        close()) and fail them, but ``keep`` (the caller's own, which save() raises for);
        returns them all."""
        left: list[_SaveJob] = []
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return left
            if job is not None:
                self._slots.release()
                left.append(job)
                if job is not keep:
                    self._abandon(job, CheckpointError(f"Checkpointer({self.root!r}) was closed during this save()"),
                                  raised=False)

    def _abandon(self, job: _SaveJob, error: BaseException, *, raised: bool) -> None:
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
            self._forget(job.pending)
            _release_state(job)
            if raised:
                job.pending._mark_observed()  # (first: no other thread's wait() raises it too)
            job.pending._fail(error)
            self._reap(retry=False)

    def _forget(self, pending: PendingSave) -> None:
        with self._pending_lock:
            if pending in self._pending:
                self._pending.remove(pending)

    @staticmethod
    def _blocking_via_window(flat: FlatState) -> bool:
        """Whether a blocking save takes the concurrent path and waits: for device state.

        Its copier copies device memory through pinned staging at the copy engine's rate, and
        its writers hash and store with the caller's thread idle, not holding the GIL. The
        stop-the-world path copied each tensor synchronously into fresh pageable memory:
        13.9 s for GPT-2 large against 7.3 s for torch.save (BENCHMARKS.md). Host
        state keeps that path: it stores the caller's memory in place, without a copy."""
        return any(span.device.type != "cpu" for span in flat.spans)

    def _fast_room(self, fast: FastTier, flat: FlatState, pending: PendingSave) -> Any:
        """A fast-tier transaction with room for ``flat`` reserved, or None (``when_busy=
        "skip"`` and no room). ``"wait"`` waits while saves or a promotion in flight may
        make room; with none in flight, no room is a StorageError that says what to change."""
        need = room_needed([s.nbytes for s in flat.spans], self.config.piece_bytes())
        piece = min(self.config.piece_bytes(), need)  # (no piece of a save is larger than the save)
        fast.set_budget(self._fast_saves_held(), need, piece)
        retained = False
        while True:
            txn = fast.begin_write()
            try:
                if txn.reserve(need, piece):
                    break
            except BaseException:
                txn.abort()
                raise
            txn.abort()  # (waiting without it: retention needs the root's lock exclusively)
            if self.config.when_busy == "skip":
                return None
            with self._pending_lock:
                others = [p for p in self._pending if p is not pending and not p.done()]
            if not others and not (self._promoter is not None and self._promoter.busy()):
                if not retained:  # a promotion that ended meanwhile may have left its checkpoint
                    retained = True  # past fast_keep_last (its retention met this save's lock)
                    self._retain(fast, self.fast_keep_last)
                    continue
                if self._promoter is not None and self._promoter.let_go_oldest_failure() is not None:
                    retained = False  # (a durable outage must not stop the fast tier: wait() raises it)
                    continue
                held = self._promoter.pending_ids() + self._promoter.failed_ids() if self._promoter is not None else []
                raise StorageError(
                    f"the fast tier {self.fast_root} has no room for this save ({need} bytes) beside the "
                    f"{self.fast_keep_last} checkpoint(s) it keeps"
                    + (f" and those kept for promotion ({', '.join(held)})" if held else "")
                    + f" (it may hold {fast.capacity()} bytes): raise Config.fast_tier_bytes or lower fast_keep_last"
                    + ("; wait() raises the failed promotions and lets them go" if held else "") + "; nothing was saved"
                )
            retained = False
            with fast._alloc:  # notified when a save commits or aborts, retention or a promotion ends
                fast._alloc.wait(0.05)
        try:
            # room for every checkpoint the tier holds at once plus this one's successor,
            # made ready in the background (storage/slab_prep.py): later saves wait for no slab
            try:
                fast.prepare_for(self.fast_keep_last + 1, need, piece)
            except Exception as exc:  # (no thread to start, say): later saves prepare their own slabs
                log.warning("gpusnap: could not prepare fast-tier slabs ahead of use: %s", exc)
        except BaseException:
            txn.abort()
            raise
        return txn

    def _start_window(
        self, repo: Repository, flat: FlatState, pending: PendingSave, phases: dict[str, float]
    ) -> ConcurrentSave | None:
        # read before the transaction opens: its view of stored chunks must include every
        # chunk the previous checkpoint committed (a later commit may replace _previous)
        previous = self._history.previous_spans(repo) if self.config.incremental else None
        compare = bool(previous) and self._history.should_compare()
        capture: ConcurrentSave | None = None
        fast_txn = None
        try:
            cuda, device_bytes = self._history.devices(flat)
            order = self._history.copy_order(flat)
            if isinstance(repo, FastTier):
                reserving = time.perf_counter()
                fast_txn = self._fast_room(repo, flat, pending)
                phases["reserve_fast"] = time.perf_counter() - reserving
                if fast_txn is None:
                    return None
                arena: Any = FastArena(fast_txn, self.config.piece_bytes())
            else:
                arena = self._staging_arena(pinned=bool(cuda))
            # Pinned allocation is slow and stalls the program while it
            # runs; so the arena grows here, once, to hold one whole capture (the first save
            # pays for it, like async_save's first call), never while a window copies.
            if device_bytes and fast_txn is None:
                with torch.inference_mode(False):  # the copier writes it (see below)
                    phases["reserve_staging"] = arena.reserve(device_bytes + self.config.piece_bytes())
            if self._warmup is not None and cuda:  # (what is left of it: see capture/warmup.py)
                warming = time.perf_counter()
                self._warmup.join()
                self._warmup = None
                phases["kernels"] = time.perf_counter() - warming
            opened = time.perf_counter()
            cow_budget, snapshot_budget = self._device_budgets(cuda)
            phases["open_window.budgets"] = time.perf_counter() - opened
            # The window's own tensors (snapshots, hash tables) are written later by gpusnap's
            # threads, which are never in inference mode: made inside it (a save from a
            # serving loop), they would refuse those writes. Only the construction: a
            # tracker pushed inside this block would lose its dispatch key when it exits.
            with torch.inference_mode(False):
                options = CaptureOptions(
                    chunk_size=self.config.chunk_size,
                    piece_bytes=self.config.piece_bytes(),
                    ahead=self.config.copy_ahead,
                    order=order,
                    cow_budget=cow_budget,
                    eager_cpu_bytes=self.config.eager_cpu_bytes,
                    log_reads=self._history.logs_reads(),
                    validate=self.config.validate,
                    previous=previous,
                    skip_unchanged=compare,
                    eager=tuple(self._history.eager_spans(flat)),
                    eager_device_bytes=self.config.eager_device_bytes,
                    snapshot_budget=snapshot_budget if self.config.device_snapshot else 0,
                    snapshot_cpu_bytes=self.config.cpu_snapshot_bytes,
                    fast=fast_txn is not None,
                )
                capture = ConcurrentSave(
                    flat,
                    # opened by the writers, off save()'s time (the fast tier's at once: it reserves)
                    repo.begin_write if fast_txn is None else (lambda: fast_txn),
                    options,
                    staging=arena,
                    io_pool=self._pool,
                    streams={d: self._copy_stream(d) for d in cuda},
                    trace=Trace(pending.id) if self.config.trace_dir else None,
                    copier_runner=self._copier_runner,
                )
            if fast_txn is not None:
                capture.txn  # noqa: B018  (bound now: a failed save aborts it with the capture's)
            window = capture.window
            window.on_close(lambda: pending._set_staged() if window.error is None else None)
            starting = time.perf_counter()
            with self._pending_lock:  # listed first: its tracker is popped (_reap) whatever happens
                self._windows.append(capture)
            capture.start()
            phases["open_window"] = time.perf_counter() - opened
            phases.update({f"open_window.{k}": v for k, v in capture.phases.items()},
                          **{"open_window.start": time.perf_counter() - starting})
        except BaseException as exc:  # (Ctrl-C included): the window closes, its copier stops
            if capture is not None:
                capture.close_out(exc)
                self._reap(retry=False)
            if fast_txn is not None:
                fast_txn.abort()
            raise
        return capture

    def _incremental_note(self, share: float | None, compared: bool) -> str:
        """``stats["incremental"]``; ``share``: the bytes this save found unchanged (None: no
        checkpoint to compare with)."""
        if not self.config.incremental:
            return "off"
        if share is None:
            return "nothing to compare with"
        if compared:
            return f"compared with the latest checkpoint: {share:.1%} of the bytes unchanged"
        return (f"not compared (copied at once, as the previous save found less than {SKIP_WORTH:.0%} "
                f"unchanged); its hashes found {share:.1%} of the bytes unchanged")

    def _device_budgets(self, cuda: list[torch.device]) -> tuple[int, int]:
        """Device bytes for copy-on-write shadows, and for a whole-state snapshot.

        Copy-on-write: ``cow_budget_bytes``, else a quarter of what is free in the driver plus
        what torch's caching allocator holds unused (host memory on CPU). Snapshot: the same,
        and at most half of what the driver has free: the allocator's free blocks are the
        program's activations of the next step; taking them would make it allocate, or make
        this allocation free cached blocks, which synchronizes the device."""
        if self.config.cow_budget_bytes:
            return self.config.cow_budget_bytes, self.config.cow_budget_bytes
        if cuda:
            free = {d: torch.cuda.mem_get_info(d)[0] for d in cuda}
            cow = min(free[d] + torch.cuda.memory_reserved(d) - torch.cuda.memory_allocated(d) for d in cuda) // 4
            return cow, min(cow, min(free.values()) // 2)
        try:
            cow = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
        except (ValueError, OSError, AttributeError):
            cow = 1 << 30
        return cow, cow

    def _staging_arena(self, *, pinned: bool) -> StagingArena:
        arena = self._staging
        if arena is None or (pinned and not arena.pinned):
            capacity = self.config.staging_capacity()
            slab = min(capacity, max(256 << 20, self.config.piece_bytes()))
            arena = self._staging = StagingArena(capacity, pinned=pinned, slab_bytes=slab)
        return arena

    def _copy_stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            low, _high = torch.cuda.Stream.priority_range()
            stream = self._streams[device] = torch.cuda.Stream(device, priority=low)
        return stream

    def _wait_for_open_window(self) -> None:
        with self._pending_lock:
            windows = list(self._windows)
        for capture in windows:
            capture.wait_captured()
        self._reap()

    def _reap(self, *, retry: bool = True) -> None:
        """Pop closed windows' trackers on this thread; forget windows fully closed; start the
        retries of saves that failed validation on this thread. Any thread may call it."""
        with self._pending_lock:
            windows = list(self._windows)
        for capture in windows:
            capture.reap()
            if capture.window.closed and _tracker_gone(capture):
                with self._pending_lock:
                    if capture in self._windows:  # (another thread may have forgotten it first)
                        self._windows.remove(capture)
        if not retry:
            return
        me = threading.current_thread()
        with self._pending_lock:
            mine = [job for job in self._retries if job.owner is me]
            self._retries = [job for job in self._retries if job.owner is not me]
        for job in mine:
            try:
                self._save(job.app_state, job.pending.tag, False, retry_of=job)
            except BaseException as exc:
                self._forget(job.pending)
                _release_state(job)
                job.pending._fail(exc)
                if not isinstance(exc, Exception):
                    raise  # Ctrl-C during the retry's save(): this call is interrupted too

    def _wait_for(self, pending: PendingSave, deadline: float | None) -> None:
        """Block until ``pending`` is done or ``deadline`` (time.monotonic) passes.

        A retry starts only on the thread that called save() (its tracker sees only that
        thread's ops; another thread cannot choose a consistent point for it): so each wait
        runs this thread's due retries, and marks the thread as waiting. A retry due on
        another thread that is not waiting in gpusnap, or has ended, is not waited for: the
        save fails at once (_give_up_retry), never hangs."""
        me = threading.current_thread()
        with self._pending_lock:
            self._waiting[me] = self._waiting.get(me, 0) + 1
        try:
            while True:
                self._reap()
                self._give_up_retry(pending, me)
                if pending.done():
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                pending._wait_done(_RETRY_POLL_S if left is None else min(_RETRY_POLL_S, left))
        finally:
            with self._pending_lock:
                self._waiting[me] -= 1
                if not self._waiting[me]:
                    del self._waiting[me]
            self._reap(retry=False)

    def _give_up_retry(self, pending: PendingSave, me: threading.Thread) -> None:
        with self._pending_lock:
            job = next((j for j in self._retries if j.pending is pending), None)
            if job is None or job.owner is me:
                return
            owner = job.owner
            assert owner is not None
            if owner.is_alive() and self._waiting.get(owner):
                return  # its wait starts the retry within _RETRY_POLL_S
            self._retries.remove(job)
            if pending in self._pending:
                self._pending.remove(pending)
        state = "was not waiting in gpusnap" if owner.is_alive() else "had ended"
        _release_state(job)
        pending._fail(ValidationError(
            f"{job.retry_note} (not retried: a retry starts only on the thread that called save(), "
            f"{owner.name!r}, at its next gpusnap call, and that thread {state} when {me.name!r} "
            "waited for it; wait for a save on the thread that made it to let a retry run)"
        ))

    def _ensure_writer(self) -> None:
        if self._writer is None or not self._writer.is_alive():
            # the thread holds the Checkpointer only while it writes a job: one the program
            # drops without close() (a notebook cell run again) is collected, and lets its
            # root's writer lease go (_let_go), instead of holding it for the process's life
            self._writer = threading.Thread(
                target=_writer_loop, args=(weakref.ref(self), self._queue, self._slots), name="gpusnap-writer",
                daemon=True,
            )
            self._writer.start()

    def _write_one(self, job: _SaveJob) -> None:
        try:
            self._run_job(job.repo if job.repo is not None else self._repository(create=True), job)
        except BaseException as exc:  # (_run_job reports its own): the save must not hang
            self._abandon(job, exc, raised=False)
        finally:
            with self._pending_lock:  # (a job handed on to its retry leaves it listed)
                if job.pending in self._pending and not job.handed_on:
                    self._pending.remove(job.pending)

    def _run_job(self, repo: Repository, job: _SaveJob) -> None:
        pending = job.pending
        capture = job.concurrent
        if capture is not None and capture.copier.streams:
            outside_graph_captures()  # finish() waits on events; the program may be capturing
        try:
            with capture.txn if capture is not None else repo.begin_write() as txn:
                if capture is not None:
                    entries = capture.finish()
                    pending._set_staged()
                    job.counters.bytes_total = sum(e.nbytes for e in entries)
                    job.counters.bytes_copied = capture.copier.bytes_copied
                    job.counters.add(written=capture.bytes_written, skipped=capture.bytes_skipped)
                else:
                    entries = write_host_spans(
                        job.flat,
                        job.host_spans,
                        txn,
                        chunk_size=self.config.chunk_size,
                        pool=self._pool,
                        counters=job.counters,
                        hashes=job.hashes,
                        piece_bytes=self.config.copy_piece_bytes,  # host copies exist: no staging limit
                    )
                job.host_spans.clear()  # release host copies before the commit's fsyncs
                duration = time.perf_counter() - job.started
                stats = {
                    "stall_s": duration if job.blocking else job.stall_s,
                    "duration_s": duration,
                    "bytes_total": job.counters.bytes_total,
                    "bytes_copied": job.counters.bytes_copied,
                    "bytes_written": job.counters.bytes_written,
                    "bytes_cow": 0,
                    "bytes_skipped": job.counters.bytes_skipped,
                    "validation": "not needed: stop-the-world capture",
                    "save_phases_s": dict(job.phases),
                    "flatten_planned": job.flat.planned,  # the previous save's plan was reused
                }
                if capture is not None:
                    stats.update(_window_stats(capture))
                    share = None
                    if capture.previous:  # the share the next save goes by (CaptureHistory.should_compare)
                        total = job.counters.bytes_total
                        share = capture.bytes_unchanged / total if total else 0.0
                        self._history.learn_unchanged(share)
                    stats["incremental"] = self._incremental_note(share, capture.compared)
                    stats["validation"] = capture.validation
                    if job.retry_note is not None:
                        stats["validation"] += f" (a retry: the first attempt failed: {job.retry_note})"
                        # its state is the program's at the retry, a later point than save()
                        stats["consistent_point"] = "retry"
                        stats["save_called"] = job.asked_at
                    stats["access_order"] = self._history.learn_window(capture)
                    trace = capture.window.trace
                    if trace is not None:
                        path = os.path.join(self.config.trace_dir, f"{pending.id}.trace.json")
                        stats["trace_path"] = trace.write(path)
                manifest = Manifest(
                    id=pending.id,
                    tag=pending.tag if self._collective is None else None,  # (the global manifest's)
                    created=job.created,
                    chunk_size=self.config.chunk_size,
                    storages=entries,
                    tree=job.flat.tree,
                    stats=stats,
                )
                txn.commit(manifest)
        except BaseException as exc:  # the save failed: report it on the handle, commit nothing
            if capture is not None:
                capture.close_out(exc)  # its copier and store tasks stopped, its txn aborted
                self._history.learn_unseen_writes(capture.mismatched)
                if isinstance(exc, ValidationError) and self._retry(job, exc):
                    return
            log.warning("gpusnap: checkpoint %s failed: %s", pending.id, exc)
            _release_state(job)
            interrupted = not isinstance(exc, Exception) and threading.current_thread() is not self._writer
            if interrupted:  # Ctrl-C in a blocking save, on the caller's thread: save() raises it
                pending._mark_observed()
            pending._fail(exc)
            if interrupted:
                raise
            return
        if self._collective is not None:
            self._settle(repo, job, manifest)
            return
        # committed: what follows never fails the save (an interrupt still propagates, after)
        info = info_from_manifest(manifest, "fast" if isinstance(repo, FastTier) else "durable")
        if job.retry_note is not None:
            log.warning("gpusnap: checkpoint %s%s holds the state at its retry (created %.3f), not at its save() "
                        "call (%.3f): the first attempt failed validation", pending.id,
                        f" (tag {pending.tag!r})" if pending.tag else "", job.created, job.asked_at or 0.0)
        try:
            info.stats["duration_s"] = time.perf_counter() - job.started
            if job.blocking:  # the caller waited through the commit too
                info.stats["stall_s"] = info.stats["duration_s"]
            self._history.learn_commit(manifest)
            if isinstance(repo, FastTier):
                self._fast_commits += 1
                due = job.promote or (self.promote_every is not None and self._fast_commits % self.promote_every == 0)
                if due:  # pinned before retention can drop it
                    self._promoter_for().submit(repo, manifest, explicit=job.promote)
                    info.stats["promotion"] = "queued"
                self._retain(repo, self.fast_keep_last)
            elif self.keep_last is not None:  # before wait() returns: list() shows keep_last
                self._retain(repo, self.keep_last)
        except Exception as exc:  # the save is committed: say what did not follow it
            log.warning("gpusnap: checkpoint %s committed, but what follows a commit failed: %r", pending.id, exc)
        finally:
            _release_state(job)  # before wait() returns: nothing of the state is held after it
            pending._finish(info)

    def _settle(self, repo: Repository, job: _SaveJob, manifest: Manifest) -> None:
        """A collective save's part is committed in this rank's root: the global decision,
        then retention (rank 0: of global manifests; every rank: of its own parts)."""
        assert self._collective is not None
        pending = job.pending
        try:
            settled = self._collective.settle(manifest, pending.tag, manifest.stats)
        except BaseException as exc:
            log.warning("gpusnap: checkpoint %s failed: %s", pending.id, exc)
            _release_state(job)
            pending._fail(exc)
            self._collective.retire(repo, manifest.id)
            if not isinstance(exc, Exception):
                raise
            return
        stats = dict(manifest.stats, duration_s=time.perf_counter() - job.started, coordination_s=settled.coordination_s,
                     coordination_phases_s=dict(settled.phases))
        if job.blocking:
            stats["stall_s"] = stats["duration_s"]
        info = CheckpointInfo(id=pending.id, tag=pending.tag, created=settled.created, nbytes=settled.nbytes,
                              stats=stats, world_size=settled.world_size)
        try:
            self._history.learn_commit(manifest)
            if self._collective.rank == 0:
                self._retain(self._collective.root_repository(create=True), self.keep_last)
            self._collective.retire(repo, manifest.id)
        except Exception as exc:  # the save is committed: say what did not follow it
            log.warning("gpusnap: checkpoint %s committed, but what follows a commit failed: %r", pending.id, exc)
        finally:
            _release_state(job)
            pending._finish(info)

    def _retain(self, repo: Repository, keep_last: int | None, *, sweep: bool = False) -> None:
        """``keep_last`` after a commit, even while the next save writes (Repository.gc pins
        what its transaction relies on). It never fails the save that just committed: an
        error is a WARNING, and the next commit tries again. ``sweep``: free the packs nothing
        references even without ``keep_last`` (after :meth:`delete`). It never compacts: that
        rewrites packs, which would compete with the next save's writes (``gpusnap gc`` does)."""
        if keep_last is None and not sweep:
            return
        try:
            report = repo.gc(keep_last, blocking=False, fresh=False, compact=False)
        except Exception as exc:
            log.warning("gpusnap: retention (keep_last=%s) failed; the next commit tries again: %s",
                        keep_last, exc)
            return
        if report.skipped:  # only a reader (verify) or an older gpusnap holds the root lock
            log.info("gpusnap: retention skipped; the next commit tries again: %s", report.notes)
        repo.warn_unreadable(report.unreadable, "retention deletes no packs while it is unreadable, so the root grows")

    def _retry(self, job: _SaveJob, error: ValidationError) -> bool:
        """Queue one retry of a save that failed validation (its offenders are now captured
        at save()); it starts at the next gpusnap call on the thread that saved (a wait on
        another thread may give it up first: _wait_for)."""
        if not self.config.retry_validation or job.retry_note is not None or job.app_state is None:
            return False
        job.retry_note = str(error)
        job.flat = None  # type: ignore[assignment]  (the retry flattens again)
        log.warning("gpusnap: checkpoint %s will be retried: %s", job.pending.id, error)
        with self._pending_lock:
            self._retries.append(job)  # its pending stays listed: ck.wait() waits for the retry
            job.handed_on = True
        return True

    # -- waiting, listing ---------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> list[CheckpointInfo]:
        """Wait for every pending save; returns the infos of those that committed.

        Then raises the error of any save (pending or earlier) that failed and whose error
        nothing has observed yet (once; see :class:`PendingSave`), else ``TimeoutError`` if
        ``timeout`` seconds passed first. A save whose retry is due on another thread that is
        not waiting in gpusnap fails at once (docs/capture.md) rather than being waited for.
        """
        self._check_process()
        self._reap()
        with self._pending_lock:
            pending = list(self._pending)
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in pending:
            self._wait_for(p, deadline)
        if self._promoter is not None:
            self._promoter.retry_failed()  # (a promotion that failed gets one more try first)
        promoted = self._promoter is None or self._promoter.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._unobserved.raise_if_any("Checkpointer.wait()")
        self._raise_promotion_failure()
        late = [p.id for p in pending if not p.done()]
        if late:
            raise TimeoutError(f"{len(late)} save(s) did not finish within {timeout} s: {', '.join(late)}")
        if not promoted:
            raise TimeoutError(f"a promotion to {self.root} did not finish within {timeout} s")
        return [info for p in pending if (info := p._info()) is not None]

    def _raise_promotion_failure(self) -> None:
        """The promotions that failed and have not succeeded since, once: their checkpoints
        were kept in the fast tier until now (fast retention applies to them again)."""
        failures = self._promoter.take_failures() if self._promoter is not None else []
        if failures:
            names = ", ".join(f"{f.checkpoint_id}" + (f" (tag {f.tag!r})" if f.tag else "") for f in failures)
            raise StorageError(
                f"promoting to the durable root {self.root} failed for {names}: they are not in {self.root}, "
                f"only in the fast tier {self.fast_root} (until its retention drops them): {failures[-1].error}"
            ) from failures[-1].error

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints of both tiers, oldest first (empty when nothing was saved
        yet). A checkpoint in both (promoted) lists once, as ``tier="durable"``."""
        found: dict[str, CheckpointInfo] = {}
        for repo in self._tiers():
            manifests, unreadable = repo.scan()
            repo.warn_unreadable(unreadable, "list() and latest() leave it out")  # once per file
            tier = "fast" if isinstance(repo, FastTier) else "durable"
            for m in manifests:
                if m.id not in found or tier == "durable":
                    found[m.id] = info_from_manifest(m, tier)
        return sorted(found.values(), key=lambda i: (i.created, i.id))

    def _tiers(self) -> list[Repository]:
        """The roots that exist: the fast tier first (it is read first), then the durable one."""
        tiers: list[Repository] = []
        if self._collective is not None:  # its checkpoints: the global manifests
            try:
                return [self._collective.root_repository(create=False)]
            except CheckpointNotFoundError:
                return []
        if self.fast_root is not None:
            try:
                tiers.append(self._fast if self._fast is not None else FastTier.open(
                    self.fast_root, config=self.config, durable_root=self._durable_identity()))
            except CheckpointNotFoundError:
                pass
        try:
            tiers.append(self._repository(create=False))
        except CheckpointNotFoundError:
            pass
        return tiers

    def _resolve(self, ref: str | None) -> tuple[Repository, Manifest, list[Any]]:
        """Where ``ref`` (id, tag, None: the newest across tiers) is read from: the fast tier
        when it holds it, else the durable root."""
        tiers = self._tiers()
        if not tiers:
            where = self.root if self.fast_root is None else f"{self.root} or {self.fast_root}"
            raise CheckpointNotFoundError(f"no checkpoint root at {where} (nothing has been saved there yet)")
        best: tuple[Repository, Manifest, list[Any]] | None = None
        errors: list[CheckpointNotFoundError] = []
        for repo in tiers:
            try:
                manifest, skipped = repo.resolve_reporting(ref)
            except CheckpointNotFoundError as exc:
                errors.append(exc)
                continue
            if ref is not None:
                return repo, manifest, skipped
            if best is None or (manifest.created, manifest.id) > (best[1].created, best[1].id):
                best = (repo, manifest, skipped)
        if best is None:  # each tier's words: each names the tags it holds
            raise errors[0] if len(errors) == 1 else CheckpointNotFoundError("; ".join(map(str, errors)))
        return best

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint, or None (a WARNING names any newer manifest that
        cannot be read)."""
        infos = self.list()
        return infos[-1] if infos else None

    def delete(self, checkpoint: str) -> None:
        """Delete one committed checkpoint (an id or a tag) from each tier that holds it, and
        free the data no other checkpoint shares (as retention does). A save still pending is
        refused (wait for it first); an unknown one is a CheckpointNotFoundError. Trainer
        plug-ins delete what their framework's own retention drops (``ModelCheckpoint``'s top k).

        >>> ckpt.delete("step-100")   # doctest: +SKIP
        """
        self._check_open()
        if not isinstance(checkpoint, str) or not checkpoint:
            raise ValueError(f"checkpoint must be an id or a tag, got {checkpoint!r}")
        if self._collective is not None:  # (it would remove this rank's part, not the checkpoint)
            raise CheckpointError("delete() of one checkpoint is per process only, not yet collective: "
                                  "keep_last retains a collective Checkpointer's checkpoints, or run "
                                  "`gpusnap gc ROOT --keep-last N`")
        with self._pending_lock:
            busy = next((p.id for p in self._pending if checkpoint in (p.id, p.tag) and not p.done()), None)
        if busy is not None:
            raise CheckpointError(f"checkpoint {busy} is still being saved: wait for it before deleting it")
        if self._promoter is not None:  # called off first: it must not commit it to the durable root after this
            self._promoter.cancel(checkpoint)
        tiers = [(self._repository(create=True), self.keep_last)]
        if self.fast_root is not None:
            tiers.append((self._fast_tier(), self.fast_keep_last))
        found = False
        for repo, keep_last in tiers:
            try:
                manifest = repo.resolve(checkpoint)
            except CheckpointNotFoundError:
                continue
            repo.delete(manifest.id)
            self._retain(repo, keep_last, sweep=True)
            found = True
        if not found:
            raise CheckpointNotFoundError(f"no committed checkpoint {checkpoint!r} under {self.root}")

    # -- restore ------------------------------------------------------------------------------
    def restore(
        self,
        app_state: MutableMapping[str, Any],
        checkpoint: str | None = None,
        *,
        lazy: bool = False,
        verify: Verify = "auto",
        strict: bool = True,
    ) -> RestoreHandle:
        """Restore ``app_state`` in place from ``checkpoint`` (an id, a tag, or None: latest).

        Tensors are overwritten in place (data pointers unchanged, so CUDA graphs captured
        earlier stay valid), Stateful values get ``load_state_dict``, plain values are replaced
        in the mapping. Every check runs before any byte is written
        (:class:`~gpusnap.RestoreMismatchError`).

        ``lazy=True`` returns once plain values and Stateful objects are back; tensors load in
        the background, in the order the program touched them when the checkpoint was taken,
        and an op on this thread that touches one not yet loaded waits for exactly that one.
        ``handle.wait()`` waits for all. See docs/restore.md for threads and guarantees.

        ``verify``: ``"upfront"`` checks every chunk before writing any byte (a corrupt
        checkpoint leaves the targets untouched; holds it in host memory); ``"stream"`` checks
        each chunk before its bytes are copied, pipelined (on corruption the error names what
        was already written); ``"off"`` skips the hashes; ``"auto"``: upfront up to 256 MiB,
        else stream. Both raise :class:`~gpusnap.IntegrityError` naming the tensor.

        ``strict=False`` restores only the keys both sides have and reports the rest as dotted
        paths: ``handle.stats["missing"]`` (in ``app_state``, not in the checkpoint) and
        ``handle.stats["unexpected"]`` (in the checkpoint, not in ``app_state``). Keys are
        those of app_state's mappings (top level and nested dicts) and of each module's
        ``state_dict()`` (a buffer the model lacks, a parameter the checkpoint lacks, as
        ``load_state_dict(strict=False)`` reports them); a key names its whole subtree
        (``"optim"``), and a Stateful value's own state (an optimizer's) is restored whole or
        not at all. Shapes and dtypes of shared keys are still checked before any byte is
        written, and no chunk that only skipped keys use is read. ``strict=True`` (default):
        any such key is a :class:`~gpusnap.RestoreMismatchError`.

        >>> h = ckpt.restore({"model": model}, strict=False)  # a training checkpoint  # doctest: +SKIP
        >>> h.stats["unexpected"]                             # doctest: +SKIP
        ['optim', 'step']
        >>> h = ckpt.restore(app_state, lazy=True)   # doctest: +SKIP
        >>> loss = model(batch)                       # waits only for what it touches  # doctest: +SKIP
        """
        self._check_open()
        self._restorer.settle()  # one restore at a time: a lazy one still loading finishes first
        self.wait()  # a restore of "latest" must see this process's own pending saves (and
        # raises one that failed unobserved: resuming must not skip it without a word)
        self._reap()
        started = time.perf_counter()
        if self._collective is not None:
            return collective_restore(self._collective, self._restorer, app_state, checkpoint,
                                      allow_pickle=self.allow_pickle, lazy=lazy, verify=verify, strict=strict,
                                      started=started)
        repo, manifest, skipped = self._resolve(checkpoint)  # "latest" must not fall back silently
        repo.warn_unreadable(skipped, f"restore() used the older checkpoint {manifest.id} instead")
        if manifest.ranks:  # a distributed checkpoint, restored by one process (docs/distributed.md)
            repo, manifest = rank_view(repo, manifest, rank=0, world_size=1)
        handle = self._restorer.restore(
            repo, manifest, app_state, allow_pickle=self.allow_pickle, lazy=lazy, verify=verify, started=started,
            strict=strict,
        )
        handle.stats["skipped_newer"] = [{"id": u.id, "reason": u.reason} for u in skipped]
        return handle

    # -- life cycle ---------------------------------------------------------------------------
    def _check_process(self) -> None:
        if os.getpid() != self._pid:  # (its threads, lease and pending saves are the parent's)
            raise CheckpointError(
                f"Checkpointer({self.root!r}) was made in process {self._pid}, which this process was forked from: "
                "make a new Checkpointer in this process (a DataLoader worker should not save)"
            )

    def _check_open(self) -> None:
        self._check_process()
        if self._closed:
            self._reap(retry=False)  # a close() on another thread left this thread's tracker
            raise CheckpointError(f"Checkpointer({self.root!r}) is closed")

    def close(self) -> None:
        """Wait for pending saves, release threads; then raise the error of any save that
        failed and whose error nothing has observed yet (once; see :class:`PendingSave`).
        A second call (from any thread) waits until the first has finished."""
        if os.getpid() != self._pid:  # a forked child: the threads and saves are the parent's
            self._closed = self._stopped = True
            return
        self._shut_down()
        self._unobserved.raise_if_any("Checkpointer.close()")
        self._raise_promotion_failure()

    def _shut_down(self) -> None:
        """close() without raising; each step may be repeated (a close() interrupted by
        Ctrl-C is finished by the next one, or at exit)."""
        with self._close_lock:
            if self._stopped:  # (by another thread, maybe: this one's tracker may be left)
                self._reap(retry=False)
                return
            self._reap()  # a retry due on this thread starts before the writer stops
            with self._enqueue_lock:
                self._closed = True
            if self._writer is not None:
                if not self._stop_sent:
                    self._ensure_writer()  # (what is queued is written even if it had ended)
                    self._stop_sent = True  # (first: a save that queues after the stop sees it)
                    self._queue.put(None)
                self._writer.join()
                self._drain_stopped()
            if self._promoter is not None:
                self._promoter.retry_failed()  # (a promotion that failed gets one more try first)
                self._promoter.stop()  # what is due is promoted before the roots are let go
            self._reap(retry=False)
            with self._pending_lock:
                late, self._retries = self._retries, []
            for job in late:  # failed validation after the last chance to retry: report it
                self._forget(job.pending)
                _release_state(job)
                job.pending._fail(ValidationError(f"{job.retry_note} (not retried: the Checkpointer closed)"))
            self._restorer.close()
            if self._warmup is not None:  # (never used by a save: not left loading at exit)
                self._warmup.join(WARMUP_JOIN_S)
            self._copier_runner.shutdown(wait=True)
            self._pool.shutdown(wait=True)
            for repo in (self._repo, self._fast):
                if repo is not None:
                    repo.close()  # the writer lease: another Checkpointer may write now
            if self._collective is not None:
                self._collective.close()
            self._stopped = True

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        """close(); when the block itself raised, its exception is never replaced: the
        failed saves nothing observed are named in notes on it (and count as observed)."""
        if exc is None or os.getpid() != self._pid:
            self.close()
            return
        self._shut_down()
        self._unobserved.note_on(exc, "while this exception left the Checkpointer's with block")

    def _at_exit(self, final: bool) -> None:
        """Interpreter exit (exit_hooks.py): finish the pending saves (``final``: close), then
        report on stderr each failure nothing observed, and any save that could not finish."""
        try:
            if final:
                self._shut_down()
            elif not self._closed:
                with self._pending_lock:
                    pending = list(self._pending)
                for p in pending:
                    self._wait_for(p, None)
                if self._promoter is not None:  # (while the interpreter still starts threads)
                    self._promoter.wait()
        except BaseException as exc:  # an exit hook must not raise; say what is lost
            with self._pending_lock:
                lost = [p.id for p in self._pending if not p.done()]
            print(f"gpusnap: at exit, the saves pending under {self.root} could not finish "
                  f"({type(exc).__name__}: {exc}); lost: {', '.join(lost) or 'none'}", file=sys.stderr, flush=True)
        self._unobserved.report(self.root)
        if final:
            self._report_promotion_failures("at exit")

    def _report_promotion_failures(self, when: str) -> None:
        """Name on stderr each promotion that failed and nothing raised (the process ends)."""
        for f in self._promoter.take_failures() if self._promoter is not None else []:
            where = "in neither tier" if f.dropped else f"only in the fast tier {self.fast_root}"
            print(f"gpusnap: {when}, promoting checkpoint {f.checkpoint_id}"
                  + (f" (tag {f.tag!r})" if f.tag else "")
                  + f" to {self.root} failed; it is {where}: {type(f.error).__name__}: {f.error}",
                  file=sys.stderr, flush=True)

    def _at_signal(self, deadline: float) -> None:
        """SIGTERM (exit_hooks.py): wait until ``deadline`` (time.monotonic) for the pending
        saves, then the promotions; name on stderr what did not finish. Runs in a signal
        handler on the main thread, which may have been inside this object: it starts
        nothing (no retry, no close) and only waits, bounded."""
        with self._pending_lock:
            pending = list(self._pending)
        for p in pending:
            while not p.done() and time.monotonic() < deadline:
                p._wait_done(min(_RETRY_POLL_S, max(0.0, deadline - time.monotonic())))
        if self._promoter is not None:
            self._promoter.wait(max(0.0, deadline - time.monotonic()))
        lost = [p.id for p in pending if not p.done()]
        lost += self._promoter.pending_ids() if self._promoter is not None else []
        if lost:
            print(f"gpusnap: SIGTERM: saves or promotions under {self.root} did not finish within "
                  f"Config.sigterm_grace_s ({self.config.sigterm_grace_s} s); lost: {', '.join(lost)}",
                  file=sys.stderr, flush=True)
        self._unobserved.report(self.root)
        self._report_promotion_failures("on SIGTERM")

    def __repr__(self) -> str:
        return f"Checkpointer({self.root!r}, keep_last={self.keep_last})"


def _writer_loop(
    ref: weakref.ref[Checkpointer], jobs: queue.Queue[_SaveJob | None], slots: threading.BoundedSemaphore
) -> None:
    while True:
        job = jobs.get()
        if job is not None:
            slots.release()  # taken off the queue: another save may queue
        owner = ref() if job is not None else None
        if owner is None:  # told to stop, or the Checkpointer is gone (its jobs with it)
            return
        owner._write_one(job)
        # neither is held while this thread waits for the next save: a finished job holds its
        # window's per-span records (~7k objects on GPT-2 large), which Python's full
        # collections would walk until then; the Checkpointer would never be collected
        del job, owner


def _let_go(jobs: queue.Queue[_SaveJob | None], repos: list[Repository]) -> None:
    """A Checkpointer collected without close(): stop its writer, release its root."""
    jobs.put_nowait(None)  # (unbounded)
    for repo in repos:
        repo.close()


def _tracker_on_stack(capture: ConcurrentSave) -> bool:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return capture.owner == threading.get_ident() and capture.tracker in _get_current_dispatch_mode_stack()


def _tracker_gone(capture: ConcurrentSave) -> bool:
    """Whether a closed window's tracker is off its thread's mode stack. Only that thread can
    pop it (modes are thread-local), at its next gpusnap call: until then another thread must
    keep the window listed, or the tracker would stay pushed for good."""
    if not capture.tracked:
        return True
    if capture.owner == threading.get_ident():
        return not _tracker_on_stack(capture)
    return all(t.ident != capture.owner for t in threading.enumerate())  # its thread has ended


def _window_stats(capture: ConcurrentSave) -> dict[str, Any]:
    w = capture.window
    closed = w.closed_at if w.closed_at is not None else w.opened
    return {
        "copies": capture.copier.copies,
        "copy_path": capture.copier.copy_path,  # "address" or "torch" (capture/address_copy.py)
        "copy_path_why": capture.copier.copy_path_why,
        "bytes_cow": w.stats.bytes_cow,
        "cow_events": w.stats.cow_events,
        "cow_failures": w.stats.cow_failures,  # shadows that found no memory: waited instead
        "waits": w.stats.waits,
        "wait_s": w.stats.wait_s,
        "window_s": closed - w.opened,
        "cow_peak_bytes": w.stats.cow_peak,
        "stream_waits": w.stats.stream_waits,
        "staging_bytes": capture.staging.nbytes,
        "staging_grow_s": capture.staging.grow_s,
        **_fast_stats(capture),
        "ops_seen": w.stats.ops_seen,
        "opaque_launches": w.stats.opaque_launches,
        "program_copies": w.stats.program_copies,
        "bytes_eager": w.bytes_eager,
        "bytes_snapshot": w.bytes_snapshot,  # copied at save() on the program's streams
        "tracked": capture.tracked,  # whether the window needed the tracker
        # the copier's steps, seconds after save() opened the window, and its waits for copies
        "copier_s": {k: round(t - w.opened, 6) for k, t in capture.copier.marks.items()}
        | {"waiting": round(capture.copier.wait_s, 6)},
    }


def _fast_stats(capture: ConcurrentSave) -> dict[str, Any]:
    """A fast save's view of its tier's slab preparation (storage/slab_prep.py)."""
    if not capture.fast:
        return {}
    tier = capture.staging.txn.tier
    return {"fast_prepared_bytes": tier.prepared_bytes(),
            # the tier's host memory (slab files) and its bound: about (fast_keep_last + 2) x the state
            "fast_tier_bytes": tier.slab_bytes(), "fast_tier_cap_bytes": tier.capacity(),
            "fast_prepare_errors": list(tier._preparer.errors),
            "fast_register_errors": list(tier.register_errors)}  # slabs copied through pageable memory
