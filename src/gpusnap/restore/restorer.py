"""The restore side of a Checkpointer: picks the path, owns what restores reuse.

Call order, from ``Checkpointer.restore``: ``settle()`` (a lazy restore still loading ends
first) -> ``restore(repo, manifest, app_state, ...)`` -> ``plan_restore`` (every check, no
byte written; with ``strict=False`` the spans only skipped keys use are emptied from the
manifest, ``Manifest.without_data``, so no path reads them) -> the root's restore server
(``restore.via_server.client``; when it serves, every byte is in place and the restore is done)
-> else one of

- ``upfront``: read and verify everything, then apply (``restore.eager``); targets untouched
  if any chunk is corrupt. ``verify="auto"`` picks it for checkpoints up to
  :data:`AUTO_UPFRONT_BYTES`, where holding them in host memory is cheap;
- ``stream``/``off``: the pipelined :class:`~gpusnap.restore.pipeline.loader.Loader`, chunks verified
  (or not, ``off``) on the way; ``restore`` returns when every copy has run;
- lazy: the same loader in the background behind the gate (:class:`LazyRestore`).

It keeps, across restores, the host staging slots (pinned when a target is on CUDA) and one
copy stream per device, and the lazy restore in progress (also registered process-wide in
``restore.active``, where every save waits for it).

``lazy=True`` where a gate could not hold (inside ``torch.inference_mode()``, or with dispatch
modes disabled: ``gate.lazy_refusal``) restores eagerly instead, with a WARNING and the reason
in ``handle.stats["lazy_refused"]``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import torch

from gpusnap.device import own_stream, synchronize
from gpusnap.handles import RestoreCompletion, RestoreHandle
from gpusnap.restore import active
from gpusnap.restore.eager import load_spans
from gpusnap.restore.lazy.gate import GateMode, lazy_refusal
from gpusnap.restore.lazy.lazy_restore import LazyRestore, pop_gate
from gpusnap.restore.pipeline.loader import Loader, device_checkable
from gpusnap.restore.pipeline.sources.direct_copies import DirectCopies, DirectUnavailable
from gpusnap.restore.pipeline.sources.reader_procs import ReaderProcs
from gpusnap.restore.pipeline.staging import SlotPool, can_share
from gpusnap.restore.pipeline.warmup import WarmUp, start_kernel_warmup
from gpusnap.restore.via_server.client import ServerClient
from gpusnap.state.apply import plan_restore
from gpusnap.state.plan import RestorePlan
from gpusnap.state.targets import SpanInfo
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.repository import Repository

__all__ = ["AUTO_UPFRONT_BYTES", "Replan", "Restorer", "Verify", "load_order", "reader_threads"]

log = logging.getLogger("gpusnap")

Verify = Literal["auto", "upfront", "stream", "off"]
# restore(replan=...): (manifest, plan) -> the manifest and plan the restore runs instead
Replan = Callable[[Manifest, RestorePlan], tuple[Manifest, RestorePlan]]
VERIFY_MODES: tuple[str, ...] = ("auto", "upfront", "stream", "off")
AUTO_UPFRONT_BYTES = 256 << 20  # verify="auto": checkpoints up to this size are verified before any write
PIECE_BYTES = 32 << 20  # a piece: one read run, one host region, one device copy (whole chunks)
# ...with direct copies: a helper's page-locking costs milliseconds per call whatever its
# size, and the copy thread's per-batch work bounds the rate (GPT-2 large training state:
# 1.06-1.23x with 64 MiB pieces). Not for every CUDA restore: twice the pinned
# bytes cost a fresh process's first restore ~0.25 s more (0.45-0.54 s against 0.22-0.28 s
# of page-locking; BENCHMARKS.md), and most restores are a first one.
DIRECT_PIECE_BYTES = 64 << 20
EXTRA_REGIONS = 4  # host regions beyond one per reader: pieces queued or in flight on the copy stream
VERIFY_ON_DEVICE: bool | None = None  # Loader's verify_on_device: None = where device hashes allow
# Reader processes at most: they share no GIL with the copy thread, so more than the threads'
# DEVICE_CHECK_READERS help, but each takes a core the copy thread and the program need too
# (on a 16-core host, a shared ring filled by 12-14 processes ran at 26-28 GB/s).
PROC_READERS = 12
WARMUP_JOIN_S = 60.0  # a warm-up left running by a failed restore: waited for this long at most
READER_PROCESSES: str | None = None  # overrides Config.restore_reader_processes when set (tests)
# Direct-copy helpers (pipeline.sources.direct_copies; off by default): 8 moved a 4 GB tmpfs file to the device
# at 42-48 GB/s, 6 at 45, 12 at 45 (more contexts to start, no faster)
DIRECT_HELPERS = 8
DIRECT_COPIES: str | None = None  # overrides Config.restore_direct_copies when set (tests)
# auto: only restores with at least this many device-checked bytes start helpers (each keeps
# ~180 MiB of device memory for its CUDA context, the landing slots 2 pieces per helper, and
# they take ~1 s to start): smaller ones gain little
DIRECT_MIN_BYTES = 1 << 30


def reader_threads(io_threads: int) -> int:
    """Readers for a restore: at least ``io_threads``, up to one per core (at most 32); the
    loader caps them when the device checks nearly every byte (``DEVICE_CHECK_READERS``).

    Verifying digests is CPU-bound (BLAKE2b, about 1 GB/s per core), so a verified restore
    scales with cores, and the program is usually waiting for it.
    """
    try:
        cores = len(os.sched_getaffinity(0))  # what this process may use, not the whole host
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(io_threads, min(32, cores))


def load_order(manifest: Manifest, plan: RestorePlan) -> tuple[list[int], str]:
    """Span indices, soonest first, and where the order came from.

    Spans ``finish()`` reads come first (restore() waits for them); then the order in which the
    program touched buffers during the save window (``manifest.stats["access_order"]``, written
    by the capture layer), then the rest in manifest order, which follows app_state and module
    registration order (for most models, roughly forward order).
    """
    n = len(manifest.storages)
    recorded = manifest.stats.get("access_order")
    source = "manifest"
    order: list[int] = sorted(plan.read_at_finish)
    if isinstance(recorded, list) and recorded:
        source = "access"
        order += [i for i in recorded if type(i) is int and 0 <= i < n]
    order += range(n)
    seen: set[int] = set()
    return [i for i in order if not (i in seen or seen.add(i))], source  # type: ignore[func-returns-value]


class Restorer:
    """Restores for one Checkpointer; see the module docstring."""

    def __init__(
        self,
        *,
        io_threads: int,
        staging_bytes: int,
        piece_bytes: int | None = None,
        verify_on_device: bool | None = None,
        scratch_slots: int | None = None,
        device_check_min_bytes: int | None = None,
        reader_processes: str = "auto",
        direct_copies: str = "auto",
        from_server: str = "auto",
        server_socket: str = "",
        pinned_upfront: bool = False,
    ) -> None:
        """``pinned_upfront``: a verify-first restore reads CUDA spans into page-locked memory
        (torch's caching host allocator: paid once, then reused), so each copy to the device
        is a DMA and not a staged pageable copy; for a caller restoring small checkpoints
        again and again (a migration target's rounds), not a one-off restore."""
        self.pinned_upfront = pinned_upfront
        self.threads = reader_threads(io_threads)
        self.server = ServerClient(from_server, server_socket)  # Config.restore_from_server
        self.reader_processes = reader_processes  # Config.restore_reader_processes
        self.direct_copies = direct_copies  # Config.restore_direct_copies
        self._procs: ReaderProcs | None = None
        self._direct: DirectCopies | None = None
        self._warmup: WarmUp | None = None  # the latest kernel warm-up (joined before the next)
        self.staging_bytes = staging_bytes  # 0: automatic
        # None: the module defaults (read at each restore, so tests can patch them)
        self.piece_bytes = piece_bytes
        self.verify_on_device = verify_on_device
        self.scratch_slots = scratch_slots
        self.device_check_min_bytes = device_check_min_bytes
        self._slots: SlotPool | None = None
        self._streams: dict[torch.device, Any] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._active: LazyRestore | None = None  # the latest lazy restore, until it is forgotten
        self._unpopped: list[tuple[GateMode, int]] = []  # gates of finished restores still pushed
        self._lock = threading.Lock()
        active.track(self)  # every save pops this Restorer's finished gates on its thread

    # -- the restore ---------------------------------------------------------------------------
    def restore(
        self,
        repo: Repository,
        manifest: Manifest,
        app_state: MutableMapping[str, Any],
        *,
        allow_pickle: bool,
        lazy: bool,
        verify: str,
        started: float,
        strict: bool = True,
        replan: Replan | None = None,
    ) -> RestoreHandle:
        """Restore ``manifest`` into ``app_state`` (see the module docstring for the paths).

        ``replan(manifest, plan)``, when given, is called once the plan is made (every check
        passed, nothing written) and returns the manifest and plan the restore then runs:
        what ``restore.delta`` uses to move only the chunks that differ from a checkpoint
        already restored into the same targets."""
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        if lazy and verify == "upfront":
            raise ValueError("verify='upfront' reads everything before writing anything; it cannot be lazy")
        refused = lazy_refusal() if lazy else None
        if refused is not None:
            log.warning("gpusnap: restore(lazy=True) of %s restores eagerly: %s", manifest.id, refused)
            lazy = False
        self.settle()
        active.wait_for_loads()  # another Checkpointer's lazy restore may be writing the same tensors
        active.retire_failed()  # and one that failed must not refuse this restore's writes
        if self._warmup is not None:  # (a restore that raised during set-up left it running)
            self._warmup.join(WARMUP_JOIN_S)
            self._warmup = None
        spans = [SpanInfo(nbytes=e.nbytes, device=e.device) for e in manifest.storages]
        plan = plan_restore(app_state, manifest.tree, spans, allow_pickle=allow_pickle, strict=strict)
        original = manifest
        if lazy and plan.sharded:  # the gate sees a DTensor's op, not the ops on its local tensor below it
            refused = "the targets include DTensors, which the lazy gate does not follow to their local tensors"
            log.warning("gpusnap: restore(lazy=True) of %s restores eagerly: %s", manifest.id, refused)
            lazy = False
        if plan.unused_spans:  # (strict=False) what only skipped keys use is read by no path below
            manifest = manifest.without_data(plan.unused_spans)
        if replan is not None:
            manifest, plan = replan(manifest, plan)
            original = manifest  # (a replanned restore is its own checkpoint for a restore server)
        n = len(manifest.storages)
        setup = _Setup(started)  # where a restore's time before the first read goes (handle.stats["setup"])
        setup.mark("plan_s")
        served = self.server.restore(repo, manifest, plan, original=original)
        if served.served:
            return self._served(manifest.id, plan, served.stats, started, n, lazy=lazy,
                                missing=plan.missing, unexpected=plan.unexpected)
        if verify == "auto":
            verify = "stream" if lazy or manifest.nbytes > AUTO_UPFRONT_BYTES else "upfront"
        done = RestoreCompletion(manifest.id, self.reap)
        handle = RestoreHandle(done)
        handle.stats.update(served.stats)
        handle.stats.update(mode="lazy" if lazy else "eager", verify=verify, threads=self.threads,
                            missing=list(plan.missing), unexpected=list(plan.unexpected),
                            resharded=list(plan.resharded))
        if refused is not None:
            handle.stats["lazy_refused"] = refused
        if verify == "upfront":
            self._upfront(repo, manifest, plan, handle, done, started)
            active.restored(_all_targets(plan, n))
            return handle
        order, source = load_order(manifest, plan)
        handle.stats["order"] = source
        cuda = _any_cuda(plan, n)
        on_device = VERIFY_ON_DEVICE if self.verify_on_device is None else self.verify_on_device
        checked = _checked_bytes(manifest, plan, on_device) if verify != "off" else {}
        if verify != "off":  # the device check's kernels load meanwhile
            self._warmup = start_kernel_warmup({d for d in checked if d.type == "cuda"}, manifest.chunk_size,
                                               self._stream)
        use_procs = self._use_procs(repo, cuda)
        direct_device = self._direct_device(repo, checked)
        slots = self._slot_pool(manifest.chunk_size, pinned=cuda, nbytes=manifest.nbytes, shared=use_procs,
                                direct=direct_device is not None)
        setup.mark("regions_s")
        use_procs = use_procs and slots.shared is not None
        procs = self._reader_procs(slots) if use_procs else None
        direct = self._direct_copies(direct_device, slots.slot_bytes) if direct_device is not None else None
        setup.mark("procs_s")
        loader = Loader(
            repo,
            manifest,
            plan,
            order=order,
            threads=self.threads,
            slots=slots,
            procs=procs,
            direct=direct,
            streams={d: self._stream(d) for d in _cuda_devices(plan, n)},
            verify=verify != "off",
            verify_on_device=on_device,
            scratch_slots=self.scratch_slots,
            device_check_min_bytes=self.device_check_min_bytes,
            span_events=lazy,  # only a lazy restore's gate waits for single spans
            warmup=self._warmup,
        )
        handle.stats["threads"] = loader.threads  # fewer when the device checks nearly everything
        setup.mark("loader_s")
        handle.stats["setup"] = setup.marks
        if lazy:
            session = LazyRestore(loader, plan, handle, done, started)
            setup.mark("prepare_s")
            done.set_on_wait(lambda: (session.refresh(), self.reap()))
            with self._lock:
                self._active = session
            try:
                session.begin()
            except BaseException:
                self._forget(session)  # restore() raised: nothing of it lingers
                raise
            return handle
        loader.prepare()
        setup.mark("prepare_s")
        loader.start()
        loader.wait()
        plan.finish()
        active.restored(_all_targets(plan, n))
        elapsed = time.perf_counter() - started
        handle.stats.update(loader.stats.as_dict())
        handle.stats.update(
            return_s=elapsed,
            total_s=elapsed,
            waits=0,
            wait_s=0.0,
            first_needed={},
        )
        done.finish()
        return handle

    def _served(self, checkpoint_id: str, plan: RestorePlan, stats: dict[str, Any], started: float, n: int, *,
                lazy: bool, missing: Sequence[str], unexpected: Sequence[str]) -> RestoreHandle:
        """The restore server put every byte in place: finish as an eager restore does. A lazy
        one is complete too: the copies ran at host-to-device speed before ``restore()`` returns."""
        plan.finish()
        active.restored(_all_targets(plan, n))
        elapsed = time.perf_counter() - started
        done = RestoreCompletion(checkpoint_id, self.reap)
        handle = RestoreHandle(done)
        handle.stats.update(stats)
        handle.stats.update(mode="eager", served_lazy=lazy, verify="server", threads=0, missing=list(missing),
                            unexpected=list(unexpected), return_s=elapsed, total_s=elapsed, bytes_read=0,
                            chunks_read=0, waits=0, wait_s=0.0, first_needed={})
        done.finish()
        return handle

    def _upfront(
        self, repo: Repository, manifest: Manifest, plan: RestorePlan, handle: RestoreHandle,
        done: RestoreCompletion, started: float,
    ) -> None:
        # page-locked only for a delta's worth (a caller's verify="upfront" of a big checkpoint
        # would keep that much page-locked in torch's host cache for the life of the process)
        pinned = self.pinned_upfront and manifest.nbytes <= AUTO_UPFRONT_BYTES
        counters = load_spans(repo, manifest, plan, pool=self._pool(), pinned=pinned)
        plan.finish()
        # the targets' devices (copies from page-locked memory are asynchronous), and the
        # manifest's as before
        for dev in _cuda_devices(plan, len(manifest.storages)) | {torch.device(e.device) for e in manifest.storages}:
            if dev.type == "cuda" and torch.cuda.is_available():
                synchronize(dev)
        elapsed = time.perf_counter() - started
        handle.stats.update(
            return_s=elapsed,
            total_s=elapsed,
            bytes_read=counters.bytes_read,
            chunks_read=counters.chunks_read,
            waits=0,
            wait_s=0.0,
            first_needed={},
        )
        done.finish()

    # -- the lazy restore in progress ----------------------------------------------------------
    def settle(self) -> None:
        """Let a lazy restore still loading finish (its error stays with its handle), then retire it."""
        with self._lock:
            session = self._active
        if session is not None:
            session.wait_over()  # (its outcome recorded in restore.active before a new restore writes)
            session.retire()
            self._forget(session)
        self.reap()

    def reap(self) -> None:
        """Forget a lazy restore that loaded everything; pop finished gates on their own thread."""
        with self._lock:
            session = self._active
        if session is not None:
            if session.done() and session.loader.error is None:
                self._forget(session)
            else:
                session.reap()  # on its own thread: checks that the gate still holds (LazyRestore.reap)
        with self._lock:
            unpopped = list(self._unpopped)
        for mode, owner in unpopped:
            if pop_gate(mode, owner):
                with self._lock:
                    self._unpopped.remove((mode, owner))

    def _forget(self, session: LazyRestore) -> None:
        """Drop the session (and through it the targets); keep its gate until it is popped."""
        with self._lock:
            if self._active is session:
                self._active = None
            if not session.reap():
                self._unpopped.append((session.mode, session.owner))

    def close(self) -> None:
        self.settle()
        if self._warmup is not None:
            self._warmup.join(WARMUP_JOIN_S)
            self._warmup = None
        self._close_procs()
        self._close_direct()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # -- reused resources ----------------------------------------------------------------------
    def _use_procs(self, repo: Repository, cuda: bool) -> bool:
        """Whether this restore reads in reader processes (``Config.restore_reader_processes``)."""
        mode = READER_PROCESSES or self.reader_processes
        return mode != "off" and _workers_can_read(repo) and (mode == "on" or cuda)

    def _reader_procs(self, pool: SlotPool) -> ReaderProcs | None:
        """The reader processes over ``pool``'s memory, kept across restores (starting them
        costs tens of ms); new ones when the pool was replaced or one of them died. None
        (the threads read) when they cannot be started."""
        procs = self._procs
        if procs is not None and procs.start_failed:  # (they never will: e.g. sys.executable is not python)
            self._stop_procs("a reader process did not start")
            return None
        if procs is None or procs.pool is not pool or not procs.alive():
            self._close_procs()  # (settle() ran: no restore is loading through them)
            try:
                procs = self._procs = ReaderProcs(min(self.threads, PROC_READERS), pool)
            except OSError as exc:
                self._stop_procs(f"reader processes could not start ({exc})")
                return None
        return procs

    def _stop_procs(self, why: str) -> None:
        """Read in threads from now on (this Restorer), after warning once."""
        warnings.warn(f"gpusnap: {why}; restores read in threads from now on", RuntimeWarning, stacklevel=4)
        self.reader_processes = "off"
        self._close_procs()

    def _close_procs(self) -> None:
        if self._procs is not None:
            self._procs.close()
            self._procs = None

    def _direct_device(self, repo: Repository, checked: dict[torch.device, int]) -> torch.device | None:
        """The device this restore's direct copies go to (``Config.restore_direct_copies``):
        of the device-checked bytes (``checked``, per device), the device with the most (CUDA
        only in ``auto``, and only for :data:`DIRECT_MIN_BYTES` or more; ``on`` also takes a
        CPU device whose check is forced, with the memfd backend the tests use). None: no
        direct copies."""
        mode = DIRECT_COPIES or self.direct_copies
        if mode == "off" or not checked or not _workers_can_read(repo):
            return None
        device = max(checked, key=lambda d: checked[d])
        if mode != "on" and (device.type != "cuda" or checked[device] < DIRECT_MIN_BYTES):
            return None
        return device

    def _direct_copies(self, device: torch.device, slot_bytes: int) -> DirectCopies | None:
        """The direct-copy helpers for ``device``, kept across restores; None when they cannot start."""
        direct = self._direct
        if direct is not None and direct.start_failed:
            self._stop_direct("a direct-copy helper did not start")
            return None
        if direct is not None and direct.cuda_error is not None:
            self._stop_direct(f"a direct-copy helper failed ({direct.cuda_error})")
            return None
        if direct is None or not direct.fits(device, slot_bytes) or not direct.alive():
            self._close_direct()  # (settle() ran: no restore is loading through them)
            try:
                direct = self._direct = DirectCopies(DIRECT_HELPERS, device, slot_bytes)
            except (DirectUnavailable, OSError, RuntimeError) as exc:
                self._stop_direct(f"direct copies could not start ({exc})")
                return None
        return direct

    def _stop_direct(self, why: str) -> None:
        """Stage every batch on the host from now on (this Restorer), after warning once."""
        warnings.warn(f"gpusnap: {why}; restores stage through host memory from now on", RuntimeWarning,
                      stacklevel=4)
        self.direct_copies = "off"
        self._close_direct()

    def _close_direct(self) -> None:
        if self._direct is not None:
            self._direct.close()
            self._direct = None

    def _slot_pool(self, chunk_size: int, *, pinned: bool, nbytes: int, shared: bool = False,
                   direct: bool = False) -> SlotPool:
        """Host regions of about :data:`PIECE_BYTES` (:data:`DIRECT_PIECE_BYTES` with direct
        copies; whole chunks), one per reader plus
        :data:`EXTRA_REGIONS`, but no more than a checkpoint of ``nbytes`` can fill, within
        ``staging_bytes`` when it is set; kept across restores, grown when a later one needs
        more. (One region per reader of 32 on a 32-core host is 1.2 GB of pinned memory,
        whose allocation a 0.2 GB model's first restore paid for nothing.)"""
        wanted = self.piece_bytes or (DIRECT_PIECE_BYTES if direct else PIECE_BYTES)
        piece = max(chunk_size, wanted // chunk_size * chunk_size)
        # one per reader: with reader processes, one per process (the loader runs no more threads;
        # if they fail to start, its threads share these regions, slower but never stuck)
        readers = min(self.threads, PROC_READERS) if shared else self.threads
        regions = min(readers, max(1, -(-nbytes // piece))) + EXTRA_REGIONS
        if self.staging_bytes:
            piece = max(chunk_size, min(piece, self.staging_bytes // regions // chunk_size * chunk_size))
            regions = max(2, min(regions, self.staging_bytes // piece))
        pool = self._slots
        if (pool is None or not pool.fits(chunk_size, pinned=pinned, shared=shared) or pool.slots < regions
                or pool.slot_bytes < piece):
            # (a restore still loading keeps the pool it was given: its Loader holds it)
            self._close_procs()  # they map the old pool's memory: let it go
            try:
                pool = SlotPool(regions, piece, pinned=pinned, shared=shared)
            except (OSError, RuntimeError) as exc:
                if not shared:
                    raise
                self._stop_procs(f"shared memory for reader processes failed ({exc})")
                pool = SlotPool(regions, piece, pinned=pinned)
            self._slots = pool
        return pool

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = own_stream(device)  # (never a pooled stream: device.py)
        return stream

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="gpusnap-restore-io")
        return self._executor


class _Setup:
    """Seconds per set-up step of a restore, each from the end of the one before: ``plan_s``
    from ``restore()``'s call (opening the manifest, then the plan), ``regions_s`` (the load
    order, then the host regions: allocated and page-locked on a Checkpointer's first
    restore), ``procs_s`` (the reader processes, started on its first; they say ready later,
    at their first request), ``loader_s``, ``prepare_s`` (the target aliases). A fresh
    process's first restore pays most of them once."""

    def __init__(self, started: float) -> None:
        self.last = started
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.marks[name] = now - self.last
        self.last = now


def _checked_bytes(manifest: Manifest, plan: RestorePlan, on_device: bool | None) -> dict[torch.device, int]:
    """Per device, the bytes of the streamed spans the loader may check there (by the
    loader's own rule, ``loader.device_checkable``: one device per span)."""
    per: dict[torch.device, int] = {}
    for i, e in enumerate(manifest.storages):
        devices = frozenset(plan.devices(i))
        if plan.streamable(i) and device_checkable(e.hashes, devices, on_device):
            (device,) = devices
            per[device] = per.get(device, 0) + e.nbytes
    return per


def _workers_can_read(repo: Repository) -> bool:
    """Whether worker processes (reader processes, direct-copy helpers) can read this
    repository's packs: shared memory here (Linux), and packs in a local directory."""
    return can_share() and repo.local_path("") is not None


def _all_targets(plan: RestorePlan, n: int) -> list[torch.Tensor]:
    return [t for i in range(n) for t in plan.targets(i)]


def _cuda_devices(plan: RestorePlan, n: int) -> set[torch.device]:
    return {d for i in range(n) for d in plan.devices(i) if d.type == "cuda"}


def _any_cuda(plan: RestorePlan, n: int) -> bool:
    return bool(_cuda_devices(plan, n))
