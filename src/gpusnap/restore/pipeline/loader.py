"""The pipelined loader: reader threads fill regions from a source, one copy thread moves them into the targets.

    readers (N):  take a batch (Schedule) -> ``source.fill``: an owned region (sources/source.py)
                  -> ``settle`` each piece: read its chunks, one system call per run stored
                  back to back, verify each chunk's BLAKE2b digest (host path) -> hand the
                  region to the copy thread (``Copier.put``)
    copy thread:  H2D copy into the targets (or into a device scratch slot, checked there
                  against the manifest's device hashes: ``pipeline.device_check``) -> span
                  loaded once its last piece is copied -> ``region.release()`` after its events

The source is one of three, picked by configuration when the loader is made: reader threads
(``host_reads.HostReads``), reader processes (``proc_reads.ProcReads``) or direct copies
into landing slots on the device (``direct_reads.DirectReads``); each falls back to the
host path for what it cannot do. Neither the readers' loop nor the copy thread knows which
source filled a region: a region says only where its bytes are (host, page-locked or not, or
already on the device after a helper's event) and goes back to its own pool through its one
``release``, exactly once, on every path.

Readers do only file I/O and hashing, which release the GIL; every CUDA call and every wait
on a CUDA event happens on the copy thread (``pipeline.copier``). A span is *loaded* once the
copies of the batch holding its last piece are queued: an event recorded then on the copy
stream covers all of its copies, since a stream runs them in the order they were queued, and
the lazy gate makes an op's stream wait for that event (one event per batch and device,
shared by the spans the batch completes).

Spans whose targets are not byte-for-byte contiguous (transposed, strided, overlapping) are
read whole into a host buffer (verified on the host) and applied at once
(``apply_bytes.apply_span``), so no tensor of theirs is ever half-written. Streamed spans are
verified piece by piece before each piece is copied into its targets: a corrupt chunk never
lands, but pieces before it in the same span may have; the error then names those tensors
(see docs/restore.md, "Guarantees").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gpusnap.device import host_buffer
from gpusnap.errors import CheckpointError
from gpusnap.restore.apply_bytes import apply_range, apply_span
from gpusnap.restore.pipeline.copier import Copier, copies_async
from gpusnap.restore.pipeline.device_check import DeviceCheck
from gpusnap.restore.pipeline.schedule import LoadSpan, Piece, Schedule, SpanState
from gpusnap.restore.pipeline.sources.direct_copies import DirectCopies
from gpusnap.restore.pipeline.sources.direct_reads import DirectReads
from gpusnap.restore.pipeline.sources.host_reads import HostReads
from gpusnap.restore.pipeline.sources.proc_reads import ProcReads
from gpusnap.restore.pipeline.sources.reader_procs import ReaderProcs
from gpusnap.restore.pipeline.sources.source import Source
from gpusnap.restore.pipeline.staging import SlotPool
from gpusnap.restore.pipeline.stats import LoadStats
from gpusnap.restore.pipeline.warmup import WarmUp
from gpusnap.state.plan import RestorePlan
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.repository import Repository

__all__ = ["DEVICE_CHECK_MIN_BYTES", "DEVICE_CHECK_READERS", "DEVICE_CHECKED", "SCRATCH_SLOTS", "Loader", "describe_span",
           "device_checkable"]

SCRATCH_SLOTS = 3  # device scratch slots per device when checking on the device (one region each)
DEVICE_CHECK_READERS = 6  # readers at most when the device checks nearly every byte (below)
BATCH_CHUNKS = 512  # chunks per batch of small spans at most (sizes the check's hash buffers)
# Smaller spans keep BLAKE2b on the host (verify_on_device=None): a hash launch costs the copy
# thread ~0.2 ms, more than hashing a few hundred KiB on a reader.
DEVICE_CHECK_MIN_BYTES = 1 << 20
# ...unless it shares a batch with other spans checkable on the device (Schedule.take_batch)
JOIN_CHECKS = True
# Device types whose spans are checked on the device in "auto" mode (verify_on_device=None)
DEVICE_CHECKED = frozenset({"cuda"})


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

    ``procs``: reader processes (``sources.reader_procs``), one per reader thread at most, over
    ``slots``'s shared memory: the source is then ``ProcReads`` (reader thread ``k`` has
    process ``k`` read its batches' runs, one request per batch, and only plans, checks and
    hands over). A batch whose request fails (a process gone, a pack removed by a gc, a short
    read) is read again by the thread itself, which raises the error the thread path raises.

    ``warmup``: the hash kernels loading on a side thread (``pipeline.warmup``); the copy
    thread waits for it before its first device check.

    ``direct``: direct-copy helpers (``sources.direct_copies``): the source is then ``DirectReads``
    (reader thread ``k`` has helper ``k``, once it is ready, copy each device-checked batch
    for the helpers' device from the page cache straight into a landing slot on the device;
    the copy thread hashes it there), over the host path of the two above. Any failure falls
    back to the host path for that batch (and a broken helper for good).
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
            checkable = verify and streamed and device_checkable(e.hashes, devices, verify_on_device)
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
        self.stats = LoadStats(reader_procs=min(self.threads, len(self.procs)) if self.procs is not None else 0,
                               direct_helpers=len(self.direct) if self.direct is not None else 0)
        # the one source the reader threads fill regions from (sources/source.py)
        self.host = HostReads(repo, manifest, slots, self.stats, lambda index: describe_span(plan, index),
                              verify=verify)
        self.source: Source = self.host if self.procs is None else ProcReads(self.procs, self.host)
        if self.direct is not None:
            self.source = DirectReads(self.direct, self.host, self.source)
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
            streams,
            self.check,
            self.stats,
            lambda index: describe_span(plan, index),
            self._close,
            span_events=span_events,
            warmup=warmup,
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
                apply_span(self.plan, ls.index, torch.empty(0, dtype=torch.uint8))
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
        reader thread ``k``, from the source."""
        piece = batch[0][0]
        ls = piece.span
        self.stats.add(batches=1, batched_spans=len(batch) if len(batch) > 1 else 0)
        if not ls.streamed:
            with self._lock:
                if ls.buffer is None:
                    ls.buffer = host_buffer(ls.nbytes, pinned=False)
                buffer = ls.buffer
            self.host.read_into(piece, memoryview(buffer[piece.offset : piece.offset + piece.nbytes].numpy()),
                                host_verify=self.verify)
            if self.schedule.piece_done(piece, 0):
                self.copier.put_whole(ls)
            return
        region = self.source.fill(batch, k, host_verify=self.verify and not ls.device_check)
        if ls.device_check or any(copies_async(d) for d in ls.devices):
            try:
                region.settle_all()
            except BaseException:
                region.release()  # never handed over: no copy reads it
                raise
            self.copier.put(region)  # the copy thread owns it now
            return
        # Host targets only: the copy is a memcpy done on return, no CUDA involved, so each
        # reader does its own rather than queueing every byte behind one copy thread.
        try:
            for j, (p, offset) in enumerate(batch):  # each member checked before it is written
                region.settle(j)
                apply_range(self.plan, p.span.index, p.offset, region.data[offset : offset + p.nbytes])
                # each member counts once written: a later member's failure must not
                # hide the tensors already restored (the error lists them)
                if self.schedule.piece_done(p, p.nbytes):
                    self.schedule.mark_loaded(p.span, ())
        finally:
            region.release()

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


def device_checkable(hashes: tuple[str, ...] | None, devices: frozenset[torch.device], on_device: bool | None) -> bool:
    """Whether a span can be checked on its device: hashes stored, one target device, allowed
    (:data:`DEVICE_CHECKED`; with ``on_device`` True, CPU targets too)."""
    if hashes is None or on_device is False or len(devices) != 1:
        return False
    (device,) = devices
    return device.type in DEVICE_CHECKED or (on_device is True and device.type == "cpu")
