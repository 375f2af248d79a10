"""The copy thread: the one thread of a restore that issues device copies and waits on CUDA.

Readers only read files and hash (both release the GIL) and hand over settled regions
(``pipeline.sources.source.Region``: host memory, or a landing slot a direct copy filled on the
device); this thread, in the order pieces arrive::

    batch (one piece, or several small whole spans of one kind; Schedule.take_batch)
          -> H2D copies into the targets (host-verified)          -> region in flight (event)
          or one H2D into a scratch slot, one hash launch for the batch, hashes D2H
             (device-checked) -> region in flight;
             later, when the slot comes round: hashes compared -> D2D copies into the targets
    whole span (non-contiguous targets) -> apply_span from its host buffer
    a batch's copies queued -> one event on the copy stream -> the spans it completes are
                               loaded (the gate may let ops through: their streams wait
                               for that event)

A region goes back to its pool (``Region.release``, whichever pool that is) once the event
after its copy has completed; the thread polls
events between pieces and blocks on the oldest only when it has nothing else to do. Keeping
every CUDA call and wait on one thread avoids a dozen threads spinning in the driver, and
the GIL ping-pong of per-chunk CUDA calls from every reader. Events are ``waitable_event``
(the host sleeps rather than spins).

After a failure the thread keeps releasing the regions readers hand over, without copying
them, until the readers have stopped; then it waits for the copies already queued and
reports (``on_close``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpusnap.device import outside_graph_captures, waitable_event
from gpusnap.errors import IntegrityError
from gpusnap.restore.apply_bytes import apply_range, apply_ranges, apply_span
from gpusnap.restore.pipeline.device_check import DeviceCheck, ScratchSlot
from gpusnap.restore.pipeline.schedule import LoadSpan, Piece, Schedule
from gpusnap.restore.pipeline.sources.source import Region
from gpusnap.restore.pipeline.stats import LoadStats
from gpusnap.state.plan import RestorePlan
from gpusnap.storage.manifest import DEVICE_HASH, Manifest

__all__ = ["ASYNC_COPY_DEVICES", "Copier", "copies_async"]

# Device types whose copies are queued on a stream and run later: a region is reused, and a span
# counts as loaded, only after an event recorded behind its copies. Copies to others are done on return.
ASYNC_COPY_DEVICES = frozenset({"cuda"})
WARMUP_WAIT_S = 300.0  # the kernel warm-up should take about a second; past this, go on without it


@dataclass(frozen=True, eq=False)
class _WholeItem:
    span: LoadSpan


_END = object()


class Copier:
    """Copies what the readers staged into the targets; see the module docstring.

    Call order: ``start()`` -> readers ``put``/``put_whole`` -> the last reader ``put_end()``
    -> ``on_close(error)`` runs on this thread once every copy has completed. Every region
    put here is released by this thread exactly once (``Region.release``), whatever happens.
    """

    def __init__(
        self,
        manifest: Manifest,
        plan: RestorePlan,
        schedule: Schedule,
        streams: dict[torch.device, Any],
        check: DeviceCheck | None,
        stats: LoadStats,
        describe: Callable[[int], str],
        on_close: Callable[[BaseException | None], None],
        *,
        span_events: bool = True,
        warmup: Any = None,
    ) -> None:
        self.manifest = manifest
        self.plan = plan
        self.schedule = schedule
        self.streams = streams
        self.check = check
        self.stats = stats
        self.describe = describe
        self.on_close = on_close
        self.span_events = span_events  # False: nobody waits for single spans (eager restore)
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._in_flight: deque[tuple[Region, Any]] = deque()  # (region, event after its copy)
        self._checking: deque[ScratchSlot] = deque()  # staged on the device, hashes not yet compared
        self._timing: dict[torch.device, Any] = {}  # timing event before each stream's first copy
        self._holding: Region | None = None  # the region being handled, until it is held
        self._ended = False  # the readers' end was taken from the queue
        self._checked = False  # a batch was staged for a device check (stats.first_check_s)
        self._warmup = warmup  # pipeline.warmup.WarmUp: joined before the first device check
        self.thread: threading.Thread | None = None

    # -- readers -------------------------------------------------------------------------------
    def put(self, region: Region) -> None:
        """A settled batch (``Region.pieces``, each at its offset in ``region.data``); this
        thread owns ``region`` from now on."""
        self._queue.put(region)

    def put_whole(self, ls: LoadSpan) -> None:
        self._queue.put(_WholeItem(ls))

    def put_end(self) -> None:
        self._queue.put(_END)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="gpusnap-restore-copy", daemon=True)
        self.thread.start()

    # -- this thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        error: BaseException | None = None
        try:
            outside_graph_captures()  # the program may capture a CUDA graph meanwhile
            for stream in self.streams.values():
                # this thread's current stream on each device, once: a stream guard per
                # copy costs host time on the thread that bounds the restore rate
                torch.cuda.set_stream(stream)
            while (item := self._next()) is not _END:
                self._handle(item)
                self._reap()
            self._ended = True  # the readers have stopped: _drain must not wait for them
            while self._checking:
                self._resolve(self._checking[0])
        except BaseException as exc:  # noqa: BLE001 (any failure stops the load; waiters must not hang)
            error = exc
            self.schedule.fail(exc)
            self._drain()
        try:
            self._finish()
        except BaseException as exc:  # noqa: BLE001 (reported through the handle)
            error = error or exc
        self.on_close(error)

    def _next(self) -> object:
        """The next item; while none is there, finish the oldest work in flight."""
        while True:
            try:
                return self._queue.get_nowait()
            except queue.Empty:
                pass
            if self._checking:
                self._resolve(self._checking[0])
            elif self._in_flight:
                self._release_oldest()
            else:
                started = time.perf_counter()
                item = self._queue.get()
                self.stats.add(copy_idle_s=time.perf_counter() - started)
                return item

    def _handle(self, item: object) -> None:
        if isinstance(item, _WholeItem):
            ls = item.span
            assert ls.buffer is not None
            self._start_timing(ls.devices)
            apply_span(self.plan, ls.index, ls.buffer)  # pageable source: copied before it returns
            ls.applied_bytes = ls.nbytes
            self._loaded([ls])
            return
        assert isinstance(item, Region)
        pieces, region = item.pieces, item
        self._holding = region  # given back in _drain or _finish if this raises
        ls = pieces[0][0].span  # every piece of a batch has the same devices and check
        if ls.device_check:
            assert self.check is not None
            (device,) = ls.devices
            slot = self.check.next_slot(device)
            if slot.pieces:
                self._resolve(slot)
            self._start_timing(ls.devices)
            first = not self._checked
            if first and self._warmup is not None:  # never race it for a first compile
                started = time.perf_counter()
                self._warmup.join(WARMUP_WAIT_S)
                self.stats.add(kernels_wait_s=time.perf_counter() - started)
            started = time.perf_counter() if first else 0.0
            if region.after is not None:  # the helper's copies, queued in its process: the hash waits for them
                self.streams[device].wait_event(region.after)
            if region.on_device:  # (held by the slot too: released once, whichever lets go first)
                slot.landing = region
            self.check.stage(slot, pieces, region.data, pinned_region=region.pinned, landed=region.on_device)
            if first:
                self._checked = True
                self.stats.add(first_check_s=time.perf_counter() - started)
            slot.event = self._event(device) if copies_async(device) else None
            self._checking.append(slot)
            if region.on_device:  # the slot reads it until its batch is applied: given back in _resolve
                self._holding = None
            else:
                self._hold(region, [slot.event] if slot.event is not None else [])
            return
        self._start_timing(ls.devices)
        loaded = self._apply(pieces, region.data, region.pinned)  # its events, when the batch completed spans, also free the region
        self._hold(region, [loaded.get(d) or self._event(d) for d in ls.devices if copies_async(d)])

    def _resolve(self, slot: ScratchSlot) -> None:
        """Compare ``slot``'s hashes (after its event) and copy its batch into the targets, or raise."""
        pieces = slot.pieces
        assert pieces and self.check is not None
        self._wait(slot.event)
        bad = self.check.mismatch(slot)
        self._checking.remove(slot)
        if bad is not None:
            slot.pieces = []
            if (landing := self._take_landing(slot)) is not None:
                landing.release()  # (its hash has run: nothing reads it any more)
            piece, chunk = bad
            digest = self.manifest.storages[piece.span.index].chunks[chunk]
            raise IntegrityError(
                f"chunk {digest} (#{chunk}) of {self.describe(piece.span.index)} does not match its device hash "
                f"({DEVICE_HASH}) after the copy to {slot.device} (corrupt); it was not written to the target"
            )
        slot.pieces = []  # the next stage() of this slot queues after these copies on the same stream
        try:
            self._apply(pieces, slot.source, False)
        finally:
            if (landing := self._take_landing(slot)) is not None:
                self._release_after_copies(landing, slot.device)

    @staticmethod
    def _take_landing(slot: ScratchSlot) -> Region | None:
        """The direct-copy landing region ``slot`` was checking, if any; ``slot`` is its own again."""
        if not slot.landed:
            return None
        landing, slot.landing = slot.landing, None
        slot.source, slot.landed = slot.data, False
        return landing

    def _release_after_copies(self, region: Region, device: torch.device) -> None:
        """Give ``region`` back once the copies queued so far on ``device`` have run."""
        if not copies_async(device):
            region.release()  # (CPU copies are done on return)
            return
        try:
            event = self._event(device)
        except BaseException:
            self._in_flight.append((region, None))  # (a broken device: _drain and _finish give it back)
            raise
        self._in_flight.append((region, event))

    def _apply(self, pieces: list[tuple[Piece, int]], data: torch.Tensor, pinned: bool) -> dict[torch.device, Any]:
        """Copy each piece of a batch from ``data`` (at its offset; ``pinned``: page-locked host
        memory) into its targets; then the spans the batch completes are loaded, after one
        event per device (returned; empty when no span completed)."""
        if len(pieces) == 1:
            piece, offset = pieces[0]
            apply_range(self.plan, piece.span.index, piece.offset, data[offset : offset + piece.nbytes],
                        non_blocking=pinned)
        else:  # small whole spans: one call queues every copy
            try:
                apply_ranges(self.plan, [(p.span.index, p.offset, o, p.nbytes) for p, o in pieces], data,
                             non_blocking=pinned)
            except BaseException as exc:
                # the members before the failing one are written (the error lists them as
                # restored), the failing one perhaps partly, the rest not at all
                written = getattr(exc, "ranges_written", None)
                if written is not None:
                    done = [p.span for p, _ in pieces[:written] if self.schedule.piece_done(p, p.nbytes)]
                    if done:
                        self._loaded(done)
                    failing = pieces[written][0]
                    self.schedule.piece_done(failing, failing.nbytes)
                raise
        complete = [piece.span for piece, _ in pieces if self.schedule.piece_done(piece, piece.nbytes)]
        return self._loaded(complete) if complete else {}

    def _loaded(self, spans: list[LoadSpan]) -> dict[torch.device, Any]:
        """The spans' last copies are queued: ops may use them once their stream passed the
        event recorded now (one per device, shared by the spans of a batch; returned)."""
        devices = {d for ls in spans for d in ls.devices if copies_async(d)} if self.span_events else set()
        events = {d: self._event(d) for d in devices}
        self.schedule.mark_loaded_many([(ls, [(d, events[d]) for d in ls.devices if d in events]) for ls in spans])
        return events

    # -- regions and events --------------------------------------------------------------------
    def _start_timing(self, devices: frozenset[torch.device]) -> None:
        """A timing event before the first copy to each CUDA device (``copy_stream_s``)."""
        for device in devices:
            if device.type == "cuda" and device not in self._timing:
                start = self._timing[device] = torch.cuda.Event(enable_timing=True)
                start.record(self.streams[device])

    def _event(self, device: torch.device) -> Any:
        stream = self.streams.get(device)  # (none: a test's host device treated as asynchronous)
        if stream is None and device.type == "cuda":
            raise KeyError(f"no copy stream for {device}")  # (every CUDA device of the plan has one)
        event = waitable_event()
        event.record(stream)
        return event

    def _hold(self, region: Region, events: list[Any]) -> None:
        """Keep ``region`` until the copies reading it have run (none on CPU: give it back now)."""
        self._holding = None
        for extra in events[:-1]:
            self._wait(extra)  # rare: one span's targets on several devices
        if events:
            self._in_flight.append((region, events[-1]))
        else:
            region.release()

    def _reap(self) -> None:
        """Give back the regions whose copies have completed, without waiting."""
        while self._in_flight and (self._in_flight[0][1] is None or self._in_flight[0][1].query()):
            self._in_flight.popleft()[0].release()

    def _release_oldest(self) -> None:
        region, event = self._in_flight.popleft()
        self._wait(event)
        region.release()

    def _wait(self, event: Any) -> None:
        if event is None:
            return
        started = time.perf_counter()
        event.synchronize()
        self.stats.add(copy_wait_s=time.perf_counter() - started)

    def _drain(self) -> None:
        """After a failure: give back every region handed over until the readers have stopped.

        Everything held is given back *first*, after the queued copies have run: a reader
        may be blocked waiting for a free region or landing slot, and the readers' end
        comes only once it has one."""
        for slot in self._checking:
            slot.pieces = []
            if (landing := self._take_landing(slot)) is not None:
                self._in_flight.append((landing, None))  # (given back below, after the streams)
        self._checking.clear()
        self._quiet(lambda: [stream.synchronize() for stream in self.streams.values()])
        while self._in_flight:  # (nothing queued reads them any more)
            self._in_flight.popleft()[0].release()
        if self._holding is not None:
            self._give_back(self._holding)
            self._holding = None
        while not self._ended:
            item = self._queue.get()
            if item is _END:
                self._ended = True
                return
            if isinstance(item, Region):
                self._give_back(item)

    def _give_back(self, region: Region) -> None:
        """Release a region no copy of this thread reads, once a helper's copy into it has run."""
        if region.after is not None:
            self._quiet(region.after.synchronize)
        region.release()

    @staticmethod
    def _quiet(wait: Callable[[], object]) -> None:
        """A wait during ``_drain``: an error here (a device broken for good runs nothing
        more) must not stop the drain, or the readers and every waiter would hang."""
        try:
            wait()
        except Exception:  # noqa: BLE001 (the load's first error is the one reported)
            pass

    def _finish(self) -> None:
        """Wait for every queued copy, give back the regions, measure the streams. The regions
        go back even when the wait fails (a broken device runs nothing more): the pool is
        kept for the next restore."""
        try:
            for stream in self.streams.values():
                stream.synchronize()
        finally:
            while self._in_flight:
                self._in_flight.popleft()[0].release()
            if self._holding is not None:
                self._holding.release()
                self._holding = None
        spans = []
        for device, start in self._timing.items():
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.streams[device])
            end.synchronize()
            spans.append(start.elapsed_time(end) / 1000.0)
        if spans:
            self.stats.copy_stream_s = max(spans)


def copies_async(device: torch.device) -> bool:
    """Whether copies to ``device`` are asynchronous (:data:`ASYNC_COPY_DEVICES`: they need an event)."""
    return device.type in ASYNC_COPY_DEVICES
