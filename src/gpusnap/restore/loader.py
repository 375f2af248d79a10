"""The pipelined loader: reader threads stage pieces, one copy thread moves them into the targets.

    readers (N):  take a piece (Schedule) -> a host region (SlotPool) -> read its chunks, one
                  system call per run stored back to back -> verify each chunk's BLAKE2b
                  digest (host path) -> hand the region to the copy thread
    copy thread:  H2D copy into the targets (or into a device scratch slot, checked there
                  against the manifest's device hashes: ``restore.device_check``) -> span
                  loaded once its last piece is copied -> regions back after their events

Readers do only file I/O and hashing, which release the GIL; every CUDA call and every wait
on a CUDA event happens on the copy thread (``restore.copier``). A span is *loaded* once the
copies of the batch holding its last piece are queued: an event recorded then on the copy
stream covers all of its copies, since a stream runs them in the order they were queued, and
the lazy gate makes an op's stream wait for that event (one event per batch and device,
shared by the spans the batch completes).

Spans whose targets are not byte-for-byte contiguous (transposed, strided, overlapping) are
read whole into a host buffer (verified on the host) and applied at once
(``RestorePlan.apply_span``), so no tensor of theirs is ever half-written. Streamed spans are
verified piece by piece before each piece is copied into its targets: a corrupt chunk never
lands, but pieces before it in the same span may have; the error then names those tensors
(see docs/restore.md, "Guarantees").
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gpusnap.device import host_buffer
from gpusnap.errors import CheckpointError
from gpusnap.restore.copier import Copier
from gpusnap.restore.device_check import DeviceCheck
from gpusnap.restore.direct import DirectCopies
from gpusnap.restore.read_procs import ReaderDied, ReaderProcs
from gpusnap.restore.warmup import WarmUp
from gpusnap.restore.schedule import LoadSpan, Piece, Schedule, SpanState
from gpusnap.restore.staging import SlotPool
from gpusnap.restore.stats import LoadStats
from gpusnap.state.apply import RestorePlan
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.repository import Repository

__all__ = ["DEVICE_CHECK_MIN_BYTES", "DEVICE_CHECK_READERS", "SCRATCH_SLOTS", "Loader", "describe_span"]

SCRATCH_SLOTS = 3  # device scratch slots per device when checking on the device (one region each)
DEVICE_CHECK_READERS = 6  # readers at most when the device checks nearly every byte (below)
BATCH_CHUNKS = 512  # chunks per batch of small spans at most (sizes the check's hash buffers)
# Smaller spans keep BLAKE2b on the host (verify_on_device=None): a hash launch costs the copy
# thread ~0.2 ms (measured on the H200 host), more than hashing a few hundred KiB on a reader.
DEVICE_CHECK_MIN_BYTES = 1 << 20
# ...unless it shares a batch with other spans checkable on the device (Schedule.take_batch)
JOIN_CHECKS = True


def describe_span(plan: RestorePlan, index: int) -> str:
    """``tensor a, b, c (+N more)`` for error messages."""
    paths = plan.span_paths.get(index, [])
    shown = ", ".join(paths[:3]) + (f" (+{len(paths) - 3} more)" if len(paths) > 3 else "")
    return f"tensor {shown}" if shown else f"storage #{index}"


class Loader:
    """Loads every span of ``manifest`` into ``plan``'s targets: ``threads`` readers, one copier.

    Call order: ``Loader(...)`` -> ``prepare()`` (optional) -> ``start()`` (on the thread whose
    CUDA streams the restore must follow) -> ``schedule.wait(span)`` / ``wait()`` from anywhere
    -> ``on_done(error)`` is called once, on the copy thread, after every copy has completed
    (or the load failed).

    ``verify_on_device``: check spans against ``StorageEntry.hashes`` on their device instead
    of BLAKE2b on the host. None (default): for streamed spans of at least
    :data:`DEVICE_CHECK_MIN_BYTES` on one CUDA device whose entry has hashes, and for
    smaller such spans that share a batch with device-checked ones (:data:`JOIN_CHECKS`); True: every
    streamed span with hashes, CPU targets too (the same code with CPU tensors, for tests);
    False: never.

    ``span_events``: record, per batch, the CUDA event a span is ready after, for ops that wait
    for single spans (a lazy restore's gate). An eager restore waits for the whole load and
    passes False: one event and one torch call fewer per batch on the copy thread.

    ``procs``: reader processes (``read_procs``), one per reader thread at most, over
    ``slots``'s shared memory: reader thread ``k`` has process ``k`` read its batches' runs
    (one request per batch) and only plans, checks and hands over. A batch whose request
    fails (a process gone, a pack removed by a gc, a short read) is read again by the thread
    itself, which raises the error the thread path raises.

    ``warmup``: the hash kernels loading on a side thread (``restore.warmup``); the copy
    thread waits for it before its first device check.

    ``direct``: direct-copy helpers (``restore.direct``): reader thread ``k`` has helper
    ``k``, once it is ready, copy each device-checked batch for the helpers' device from the
    page cache straight into a landing slot on the device; the copy thread hashes it there.
    Any failure falls back to the host path for that batch (and a broken helper for good).
    """

    def __init__(
        self,
        repo: Repository,
        manifest: Manifest,
        plan: RestorePlan,
        *,
        order: Sequence[int],
        threads: int,
        slots: SlotPool,
        streams: dict[torch.device, Any],
        verify: bool,
        verify_on_device: bool | None = None,
        on_done: Callable[[BaseException | None], None] | None = None,
        scratch_slots: int | None = None,
        device_check_min_bytes: int | None = None,
        span_events: bool = True,
        procs: ReaderProcs | None = None,
        warmup: WarmUp | None = None,
        direct: DirectCopies | None = None,
    ) -> None:
        if slots.slot_bytes < manifest.chunk_size:
            raise ValueError(f"staging slots of {slots.slot_bytes} bytes cannot hold {manifest.chunk_size}-byte chunks")
        self.repo = repo
        self.manifest = manifest
        self.plan = plan
        self.slots = slots
        self.streams = streams
        self.verify = verify
        self.on_done = on_done
        self.chunk_size = manifest.chunk_size
        min_check = DEVICE_CHECK_MIN_BYTES if device_check_min_bytes is None else device_check_min_bytes
        spans = []
        for i, e in enumerate(manifest.storages):
            devices = frozenset(plan.devices(i))
            streamed = plan.streamable(i)
            checkable = verify and streamed and _checkable(e.hashes, devices, verify_on_device)
            spans.append(
                LoadSpan(
                    index=i,
                    nbytes=e.nbytes,
                    chunks=len(e.chunks),
                    streamed=streamed,
                    devices=devices,
                    device_check=checkable and (verify_on_device is True or e.nbytes >= min_check),
                    checkable=checkable,
                )
            )
        piece_chunks = slots.slot_bytes // self.chunk_size
        self.batch_room = piece_chunks * self.chunk_size  # a batch fits a region and a scratch slot
        self.batch_chunks = max(piece_chunks, BATCH_CHUNKS)
        self.schedule = Schedule(spans, order, chunk_size=self.chunk_size, piece_chunks=piece_chunks,
                                 join_checks=JOIN_CHECKS)
        # the bytes of spans checked on the device (small checkable ones mostly are, in batches)
        on_device = [ls.nbytes for ls in spans if (ls.checkable if JOIN_CHECKS else ls.device_check)]
        self.check = (
            DeviceCheck(manifest, spans, slot_bytes=piece_chunks * self.chunk_size, max_chunks=self.batch_chunks,
                        slots=SCRATCH_SLOTS if scratch_slots is None else scratch_slots)
            if on_device
            else None
        )
        pieces = sum(-(-ls.chunks // piece_chunks) for ls in spans)
        self.threads = max(1, min(threads, pieces or 1))
        total = sum(ls.nbytes for ls in spans)
        host_hashed = total - sum(on_device) if verify else 0
        if self.check is not None and host_hashed * 8 < total:
            # nearly every byte is checked on the device: readers only copy from the page
            # cache, and more of them take the GIL from the copy thread that bounds the rate
            self.threads = min(self.threads, DEVICE_CHECK_READERS)
        self.procs = procs if procs is not None and slots.shared is not None else None
        if self.procs is not None:
            # no GIL shared with the copy thread: the cap above does not apply
            self.threads = max(1, min(len(self.procs), pieces or 1))
        self.direct = direct if direct is not None and self.check is not None else None
        if self.direct is not None:
            # a thread per helper: it mostly sleeps in a pipe read while its helper copies
            self.threads = max(self.threads, min(len(self.direct), pieces or 1))
        self._no_proc: set[int] = set()  # reader threads whose process is gone
        self._no_direct: set[int] = set()  # reader threads whose direct-copy helper is gone
        self._local: dict[str, str | None] = {}  # pack path -> local path for the processes
        self._what: dict[int, str] = {}  # span index -> describe_span (for errors)
        self.stats = LoadStats(reader_procs=min(self.threads, len(self.procs)) if self.procs is not None else 0,
                               direct_helpers=len(self.direct) if self.direct is not None else 0)
        self.started = 0.0
        self.finished: float | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._alive = 0
        self._launched = False
        self._done = threading.Event()
        self.copier = Copier(
            manifest,
            plan,
            self.schedule,
            slots,
            streams,
            self.check,
            self.stats,
            lambda index: describe_span(plan, index),
            self._close,
            span_events=span_events,
            warmup=warmup,
            direct=self.direct,
        )

    @property
    def bytes_read(self) -> int:
        return self.stats.bytes_read

    @property
    def chunks_read(self) -> int:
        return self.stats.chunks_read

    # -- life cycle ----------------------------------------------------------------------------
    def prepare(self) -> None:
        """Build the aliases the copies write through (``RestorePlan.prepare_byte_views``): on
        the restoring thread, before ``start()`` and outside a lazy restore's gate. Built
        later, on the copy thread, each of their torch calls competes with the readers for the
        GIL. Optional: whatever is not built here is built when first needed."""
        self.plan.prepare_byte_views(ls.index for ls in self.schedule.spans if ls.streamed and ls.chunks)

    def start(self) -> None:
        self.started = time.perf_counter()
        for device, stream in self.streams.items():
            # Copies follow the work the program already queued: a kernel still reading a target
            # must not see the restored bytes early. (Queued, not waited for: no host sync.)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            stream.wait_event(event)
        for ls in self.schedule.spans:
            if ls.chunks == 0:
                self.plan.apply_span(ls.index, torch.empty(0, dtype=torch.uint8))
        self._alive = self.threads
        self._launched = True
        self.copier.start()
        for i in range(self.threads):
            threading.Thread(target=self._run, args=(i,), name=f"gpusnap-restore-{i}", daemon=True).start()

    def done(self) -> bool:
        return self._done.is_set()

    def join(self, timeout: float | None = None) -> bool:
        """Until the load has stopped and every copy has run; True if it has (or never ran)."""
        return not self._launched or self._done.wait(timeout)

    def wait(self, timeout: float | None = None) -> None:
        """Until every span is loaded and its copies have run; raises the load's error."""
        if not self.join(timeout):
            raise TimeoutError(f"restore of {self.manifest.id} still loading after {timeout} s")
        if self.error is not None:
            raise self.error

    # -- reader threads ------------------------------------------------------------------------
    def _run(self, k: int = 0) -> None:
        try:
            while batch := self.schedule.take_batch(self.batch_room, self.batch_chunks):
                self._read(batch, k)
        except BaseException as exc:  # noqa: BLE001 (any failure stops the load; waiters must not hang)
            self.schedule.fail(exc)
        finally:
            with self._lock:
                self._alive -= 1
                last = self._alive == 0
            if last:
                self.copier.put_end()

    def _read(self, batch: list[tuple[Piece, int]], k: int = 0) -> None:
        """Read a batch (one piece, or several whole small spans of one kind; schedule.py) on
        reader thread ``k``."""
        piece = batch[0][0]
        ls = piece.span
        self.stats.add(batches=1, batched_spans=len(batch) if len(batch) > 1 else 0)
        if ls.streamed:
            if ls.device_check and self._copy_direct(batch, k):
                return
            started = time.perf_counter()
            region = self.slots.acquire()
            self.stats.add(region_wait_s=time.perf_counter() - started)
            view = self.slots.bytes_of(region)
            if ls.device_check or any(Copier._evented(d) for d in ls.devices):
                try:
                    host_verify = self.verify and not ls.device_check
                    read = self._read_in_process(batch, region, k)
                    for p, offset in batch:
                        self._fill(p, offset, view, read, host_verify=host_verify)
                except BaseException:
                    self.slots.release(region)  # never handed over: no copy reads it
                    raise
                self.copier.put_pieces(batch, region)
                return
            # Host targets only: the copy is a memcpy done on return, no CUDA involved, so each
            # reader does its own rather than queueing every byte behind one copy thread.
            try:
                read = self._read_in_process(batch, region, k)
                for p, offset in batch:  # each member checked before it is written (as the thread path)
                    self._fill(p, offset, view, read, host_verify=self.verify)
                    self.plan.apply_range(p.span.index, p.offset, region[offset : offset + p.nbytes])
                    # each member counts once written: a later member's failure must not
                    # hide the tensors already restored (the error lists them)
                    if self.schedule.piece_done(p, p.nbytes):
                        self.schedule.mark_loaded(p.span, ())
            finally:
                self.slots.release(region)
            return
        with self._lock:
            if ls.buffer is None:
                ls.buffer = host_buffer(ls.nbytes, pinned=False)
            buffer = ls.buffer
        self._read_into(piece, memoryview(buffer[piece.offset : piece.offset + piece.nbytes].numpy()),
                        host_verify=self.verify)
        if self.schedule.piece_done(piece, 0):
            self.copier.put_whole(ls)

    def _plan_runs(self, batch: list[tuple[Piece, int]], base: int) -> tuple[dict[int, _Read], list[tuple[str, int, int, int]]] | None:
        """Each piece's read (by ``id(piece)``) and the runs ``(local path, pack offset, length,
        base + offset in the batch)`` a worker process reads for the batch; None when a pack
        has no local path (the thread reads it)."""
        reads: dict[int, _Read] = {}
        requests: list[tuple[str, int, int, int]] = []
        for p, offset in batch:
            what = self._describe(p.span.index)
            digests = self.manifest.storages[p.span.index].chunks[p.first : p.first + p.count]
            runs = self.repo.chunk_runs(digests, self.chunk_size, p.nbytes, what=what)
            for path, pack_offset, first, n in runs:
                local = self._local.get(path, "")
                if local == "":
                    local = self._local[path] = self.repo.local_path(path)
                if local is None:
                    return None
                lo, hi = first * self.chunk_size, min(p.nbytes, (first + n) * self.chunk_size)
                requests.append((local, pack_offset, hi - lo, base + offset + lo))
            reads[id(p)] = _Read(p, offset, digests, runs, what)
        return reads, requests

    def _read_in_process(self, batch: list[tuple[Piece, int]], region: torch.Tensor, k: int) -> dict[int, _Read] | None:
        """Have reader process ``k`` read the whole batch into ``region`` (one request): each
        piece's read (by ``id(piece)``), to check and count with ``_check_read``; None when the
        thread must read the batch itself."""
        if self.procs is None or k in self._no_proc:
            return None
        planned = self._plan_runs(batch, self.slots.offset_of(region))
        if planned is None:
            return None
        reads, requests = planned
        started = time.perf_counter()
        if self._ask(lambda: (self.procs.read(k, requests), None), requests, k, self._no_proc,
                     "proc_fallbacks") is None:
            return None
        self.stats.add(proc_batches=1, read_s=time.perf_counter() - started)
        return reads

    def _copy_direct(self, batch: list[tuple[Piece, int]], k: int) -> bool:
        """Have direct-copy helper ``k`` copy a device-checked batch into a landing slot and hand
        it to the copy thread; False (nothing done) when the host path must stage it: no
        helper here, or still starting, or broken, or the copy failed."""
        direct = self.direct
        if direct is None or k in self._no_direct or batch[0][0].span.devices != {direct.device}:
            return False
        try:
            if not direct.ready(k):
                return False  # still starting (a Checkpointer's first restores): stage on the host
        except ReaderDied:
            self._no_direct.add(k)
            self.stats.add(direct_fallbacks=1)
            return False
        started = time.perf_counter()
        landing = direct.landing.acquire()
        self.stats.add(region_wait_s=time.perf_counter() - started)
        handed = False
        try:
            planned = self._plan_runs(batch, direct.landing.offset_of(landing))
            if planned is None:
                return False
            reads, requests = planned
            started = time.perf_counter()
            answer = self._ask(lambda: direct.copy(k, requests), requests, k, self._no_direct, "direct_fallbacks")
            if answer is None:
                return False
            self.stats.add(direct_batches=1, direct_s=time.perf_counter() - started)
            for read in reads.values():
                self._count(read.piece, reads=len(read.runs), read_s=0.0, verify_s=0.0, host_verify=False)
            self.copier.put_pieces(batch, landing, landed=True, after=answer[1])
            handed = True
            return True
        finally:
            if not handed:
                direct.landing.release(landing)

    def _ask(self, request: Callable[[], tuple[list[int], Any]], runs: list[tuple[str, int, int, int]], k: int,
             gone: set[int], fallbacks: str) -> tuple[list[int], Any] | None:
        """A worker process's answer to reader thread ``k``'s ``request`` for ``runs`` (bytes
        got per run, and what else it returns); None, counted under stats ``fallbacks``, when
        the thread's host path must do the batch instead: the worker died (thread ``k`` goes
        into ``gone``, for the rest of the load), a pack is gone (a gc) or unreadable, or a run
        came back short (the host path explains either, naming the chunk)."""
        try:
            answer = request()
        except ReaderDied:
            gone.add(k)
            self.stats.add(**{fallbacks: 1})
            return None
        except OSError:
            self.stats.add(**{fallbacks: 1})
            return None
        if any(g != r[2] for g, r in zip(answer[0], runs)):
            self.stats.add(**{fallbacks: 1})
            return None
        return answer

    def _fill(self, piece: Piece, offset: int, view: memoryview, read: dict[int, _Read] | None, *,
              host_verify: bool) -> None:
        """``piece``'s bytes at ``offset`` of ``view``: read by this thread when its process did
        not read the batch (``read`` is None), else checked as its process read them."""
        if read is None:
            self._read_into(piece, view[offset : offset + piece.nbytes], host_verify=host_verify)
        else:
            self._check_read(read[id(piece)], view, host_verify=host_verify)

    def _describe(self, index: int) -> str:
        """``describe_span`` of span ``index``, made once (every read of it names it for errors)."""
        what = self._what.get(index)
        if what is None:
            what = self._what[index] = describe_span(self.plan, index)
        return what

    def _check_read(self, read: _Read, view: memoryview, *, host_verify: bool) -> None:
        """A piece a reader process read: its chunks' digests checked on the host if asked; counted."""
        p = read.piece
        started = time.perf_counter()
        if host_verify:
            self.repo.check_runs(read.digests, view[read.offset : read.offset + p.nbytes], self.chunk_size,
                                 read.runs, what=read.what)
        self._count(p, reads=len(read.runs), read_s=0.0, verify_s=time.perf_counter() - started,
                    host_verify=host_verify)

    def _count(self, piece: Piece, *, reads: int, read_s: float, verify_s: float, host_verify: bool) -> None:
        verified = piece.nbytes if self.verify else 0
        self.stats.add(
            bytes_read=piece.nbytes,
            chunks_read=piece.count,
            pieces=1,
            reads=reads,
            read_s=read_s,
            verify_s=verify_s,
            host_verified_bytes=verified if host_verify else 0,
            device_verified_bytes=0 if host_verify else verified,
        )

    def _read_into(self, piece: Piece, out: memoryview, *, host_verify: bool) -> None:
        digests = self.manifest.storages[piece.span.index].chunks[piece.first : piece.first + piece.count]
        cost = self.repo.read_chunks_into(
            digests,
            out,
            self.chunk_size,
            what=self._describe(piece.span.index),
            verify=host_verify,
        )
        self._count(piece, reads=cost.reads, read_s=cost.read_s, verify_s=cost.verify_s, host_verify=host_verify)

    # -- copy thread, at the end ---------------------------------------------------------------
    def _close(self, error: BaseException | None) -> None:
        """Every copy has run (or the load failed): publish the outcome."""
        self.plan.forget_byte_views()
        error = self.schedule.error or error
        if error is None and not self.schedule.all_loaded:
            error = CheckpointError("restore stopped before every storage was loaded")
        self.error = None if error is None else self._explain(error)
        self.finished = time.perf_counter()
        self.schedule.close(self.error)
        self._done.set()
        if self.on_done is not None:
            self.on_done(self.error)

    def _explain(self, error: BaseException) -> BaseException:
        """``error``, same type, plus which targets were written before the load stopped."""
        spans = self.schedule.spans
        loaded = [ls for ls in spans if ls.state is SpanState.LOADED and ls.nbytes]
        partial = [ls for ls in spans if ls.state is not SpanState.LOADED and ls.applied_bytes]
        if not loaded and not partial:
            note = "no tensor was written"
        else:
            note = f"{len(loaded)} of {sum(1 for ls in spans if ls.nbytes)} storages were restored"
            if partial:
                note += "; partly written: " + "; ".join(describe_span(self.plan, ls.index) for ls in partial)
            note += "; the other tensors keep their previous values. Restore again before using them"
        message = f"{error} [restore of {self.manifest.id} stopped: {note}]"
        if isinstance(error, CheckpointError):
            try:
                explained = type(error)(message)
            except TypeError:
                explained = CheckpointError(message)
        else:
            explained = CheckpointError(message)
        explained.__cause__ = error
        return explained


@dataclass
class _Read:
    """A piece a reader process read, with what checking it needs."""

    piece: Piece
    offset: int  # in the region
    digests: tuple[str, ...]
    runs: list[tuple[str, int, int, int]]  # Repository.chunk_runs
    what: str


def _checkable(hashes: tuple[str, ...] | None, devices: frozenset[torch.device], on_device: bool | None) -> bool:
    """Whether a span can be checked on its device: hashes stored, one target device, allowed."""
    if hashes is None or on_device is False or len(devices) != 1:
        return False
    (device,) = devices
    return device.type == "cuda" or (on_device is True and device.type == "cpu")
