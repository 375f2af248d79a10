"""The copy engine: moves every span of a window off its device, piece by piece.

One named thread per window walks the spans in priority order (``CaptureWindow.take_next``)
and copies each piece (``Config.copy_piece_bytes``, whole chunks) into a region of
the staging arena; once the copy has completed it hands the region to the ``sink`` (hash +
store, on writer threads), which releases it. Only this thread waits on CUDA events.

On CUDA each piece is an async copy on a low-priority stream (ordered after the consistent
point's event) followed by an event. At most ``ahead`` pieces' worth of bytes
(``ahead * piece_bytes``; one piece by default) are in flight at once: the copy engine serves
a queue back to back, so with a second piece waiting it never runs dry and the program's own
small device-to-host copies wait behind the whole capture (``Config.copy_ahead``; so the
count of copies is bounded too, not only their bytes). A program write to a span likewise
only ever waits (on the device) for copies already issued. Finished pieces are taken in
batches (wait for the oldest, then take every one already done) and handed to the sink in one call:
a model has hundreds of small spans, and a thread waking per piece, with a writer task per
piece, competes with the program's own thread for the GIL thousands of times a second. The
window closes only when every copy has completed. While the program has its own
host<->device copy in flight, no new piece is issued (the program's copies go first).
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Executor
from typing import Any

import torch

from gpusnap.capture.address_copy import DriverCopies, HostCopies, address_copies
from gpusnap.capture.staging import Region, StagingArena
from gpusnap.capture.window import SNAPSHOT_ALIGN, CaptureWindow, WindowSpan
from gpusnap.device import outside_graph_captures, waitable_event

__all__ = ["Copier", "Piece", "PieceSink", "Segment"]

# (span, start byte, nbytes, offset in the staging region): a run of whole chunks of one span
# (the last may be short)
Segment = tuple[WindowSpan, int, int, int]
# A finished copy: each segment's bytes lie at its offset in the region.
Piece = tuple[list[Segment], Region]
# sink(pieces): takes a batch of finished pieces; it must release each region to the arena.
PieceSink = Callable[[list[Piece]], None]


class Copier:
    def __init__(
        self,
        window: CaptureWindow,
        arena: StagingArena,
        sink: PieceSink,
        *,
        chunk_size: int,
        piece_bytes: int,
        ahead: int,
        consistent_events: dict[torch.device, Any],
        streams: dict[torch.device, Any],
        prepare: Callable[[], None] | None = None,
        skip: Callable[[WindowSpan], Collection[int]] | None = None,
        after_copy: Callable[[WindowSpan, int, torch.Tensor], None] | None = None,
        on_drained: Callable[[], None] | None = None,
        after_close: Callable[[], None] | None = None,
        runner: Executor | None = None,
    ) -> None:
        if piece_bytes % chunk_size or piece_bytes > arena.max_region():
            raise ValueError("a copy piece must be whole chunks and fit in one staging region")
        self.window = window
        self.arena = arena
        self.sink = sink
        self.chunk_size = chunk_size
        self.piece_bytes = piece_bytes
        self.ahead = max(1, ahead)
        self.events = consistent_events
        self.streams = streams
        self.trace = window.trace
        self.prepare = prepare  # runs on this thread (on the copy streams) before any copy
        self.skip = skip  # chunk indices of a span that need no copy (incremental saves)
        self.after_copy = after_copy  # hashes a piece's source right after its copy (CUDA)
        self.on_drained = on_drained  # every copy completed; runs before the window closes
        self.after_close = after_close  # runs on this thread (copy streams current) once the
        # window has closed without error; what it raises is kept in ``after_close_error``
        self.after_close_error: BaseException | None = None
        self.bytes_copied = 0
        self.copies = 0  # pieces copied (one copy call each)
        # when this thread reached each step (perf_counter), and its time waiting for copies:
        # stats["copier_s"], to tell a late start from a slow copy
        self.marks: dict[str, float] = {}
        self.wait_s = 0.0
        self.max_inflight = self.ahead * piece_bytes  # bytes
        self._inflight: deque[tuple[Any, float, list[Segment], Region, int]] = deque()
        self._inflight_bytes = 0
        self._engines: list[HostCopies | DriverCopies] = []  # by-address copies (_copy_snapshots)
        self.copy_path = "torch"  # "address" once a snapshot went by address (stats["copy_path"])
        self.copy_path_why = ""  # why a snapshot went through torch instead (stats["copy_path_why"])
        # A Checkpointer's one long-lived copier thread (``runner``): starting a thread per
        # save cost save() ~5 ms on a busy 2-core machine (Thread.start waits for it to run).
        self._runner = runner
        self._finished = threading.Event()
        self._started = False

    def start(self) -> None:
        self._started = True
        for device, stream in self.streams.items():
            stream.wait_event(self.events[device])  # copies read the state as of save()
        if self._runner is not None:
            try:
                self._runner.submit(self._run)
                return
            except RuntimeError:  # shut down (a close() racing this save, interpreter exit)
                pass
        threading.Thread(target=self._run, name="gpusnap-copier", daemon=True).start()

    def join(self, timeout: float | None = None) -> None:
        if self._started:  # (a copier never started has nothing to wait for)
            self._finished.wait(timeout)

    def _run(self) -> None:
        try:
            self._copy_all()
        finally:
            # The callbacks are the save's bound methods, and the save holds this copier: let
            # go of them so that a finished save is freed by reference counting. Left as a
            # cycle, each save of GPT-2 large left ~9k objects (its window's per-span records)
            # for Python's full collections, which ran on the program's thread.
            self.sink = _closed_sink
            self.prepare = self.skip = self.after_copy = self.on_drained = self.after_close = None
            self._finished.set()

    def _copy_all(self) -> None:
        self.marks["started"] = time.perf_counter()
        try:
            if self.streams:
                outside_graph_captures()  # the program may capture a CUDA graph meanwhile
            for stream in self.streams.values():
                torch.cuda.set_stream(stream)  # this thread's copies go to the copy streams
            if self.prepare is not None:
                started = time.perf_counter()
                self.prepare()
                self._traced("prepare", started)
                self.marks["prepared"] = time.perf_counter()
            if self.window.all_snapshotted:
                self._copy_snapshots()
            else:
                while (ws := self.window.take_next()) is not None:
                    self._copy_span(ws)
                    self.window.mark_captured(ws)
            self.marks["issued"] = time.perf_counter()
            self._drain(0)
            self.marks["drained"] = time.perf_counter()
            if self.on_drained is not None:
                self.on_drained()
            self.window.close()
            if self.after_close is not None:
                try:
                    self.after_close()
                except BaseException as exc:  # the window is closed: the save fails at finish
                    traceback.clear_frames(exc.__traceback__)
                    self.after_close_error = exc
        except BaseException as exc:  # the save fails; the program must not wait forever
            # Copies and hash kernels already queued may still write the staging regions and
            # hash tables: let them finish before anything is handed back.
            for stream in self.streams.values():
                with contextlib.suppress(BaseException):
                    stream.synchronize()
            for *_, region, _n in self._inflight:
                self.arena.release(region)
            self._inflight.clear()
            self._inflight_bytes = 0
            # The error is kept (window.error, the PendingSave); its frames' locals must not
            # keep the snapshot buffers (device memory) alive with it.
            traceback.clear_frames(exc.__traceback__)
            self.window.close(exc)
        finally:
            engines, self._engines = self._engines, []
            for engine in engines:  # (every copy has completed or its stream was synchronized)
                engine.close()

    def _copy_span(self, ws: WindowSpan) -> None:
        stream = self.streams.get(ws.device) if ws.device.type == "cuda" else None
        piece = self.piece_bytes  # CPU too: one writer task stores a piece's chunks in order
        held: set[str] = set()  # which sources (live, shadow) were recorded on the copy stream
        cs = self.chunk_size
        started = time.perf_counter()
        skip = self.skip(ws) if self.skip is not None else ()
        if self.skip is not None:
            self._traced("skip", started)
        for start, n in _changed_runs(ws.nbytes, skip, cs, piece):
            if self.window.error is not None:
                raise self.window.error
            if start > ws.issued:  # (only this thread advances ``issued``)
                self.window.skip_to(ws, start)  # chunks unchanged since the last checkpoint
            if stream is not None:
                self._make_room(n)
                self._yield_to_program_copy()
            region = self._allocate(n)
            try:
                event = self._issue(ws, start, n, region, stream, held)
            except BaseException:
                self.arena.release(region)
                raise
            self._issued([(ws, start, n, 0)], region, n, event)
        if ws.issued < ws.nbytes:
            self.window.skip_to(ws, ws.nbytes)  # trailing unchanged chunks

    def _issued(self, segments: list[Segment], region: Region, n: int, event: Any) -> None:
        if not self.copies:
            self.marks["first_copy"] = time.perf_counter()
        self.copies += 1
        self.bytes_copied += sum(seg[2] for seg in segments)  # (not the padding between them)
        if event is None:
            self._hand_over([(segments, region)])  # CPU: already copied
        else:
            self._inflight.append((event, time.perf_counter(), segments, region, n))
            self._inflight_bytes += n

    def _copy_snapshots(self) -> None:
        """Every span is a snapshot taken at save(), and the snapshots of one device lie back
        to back in one buffer (``CaptureWindow.snapshot_buffers``). Nothing can write them, so
        there is no order to keep and no state to update per piece: copy each run of changed
        chunks that sit next to each other in the buffer as one piece (a model's hundreds of
        small tensors then make a few dozen copies, not hundreds of Python round trips). The
        runs are found from the buffer offsets alone: no tensor per span."""
        cs, piece = self.chunk_size, self.piece_bytes
        for snap in self.window.snapshot_buffers():
            buffer = snap.buffer
            stream = self.streams.get(buffer.device) if buffer.device.type == "cuda" else None
            started = time.perf_counter()
            segments: list[Segment] = []  # (span, start, bytes, position in the buffer)
            for ws, offset in zip(snap.spans, snap.offsets):
                skip = self.skip(ws) if self.skip is not None else ()
                for start, n in _changed_runs(ws.nbytes, skip, cs, piece):
                    segments.append((ws, start, n, offset + start))
            if self.skip is not None:
                self._traced("skip", started)
            if stream is not None and segments:
                buffer.record_stream(stream)  # the buffer outlives our copies
            engine = self._engine(buffer.device, stream) if segments else None
            source = buffer.data_ptr()
            for run, base, n in _adjacent_runs(segments, piece):
                if self.window.error is not None:
                    raise self.window.error
                if stream is not None:
                    self._make_room(n)
                    self._yield_to_program_copy()
                region = self._allocate(n)
                issued_at = time.perf_counter()
                try:
                    if engine is not None:  # by address: no tensor or torch call per piece
                        event = engine.copy(region.data.data_ptr(), source + base, n)
                    else:
                        region.data[:n].copy_(buffer[base : base + n], non_blocking=stream is not None)
                        event = None
                        if stream is not None:
                            event = waitable_event()
                            event.record(stream)
                except BaseException:
                    self.arena.release(region)
                    raise
                if event is None and self.trace is not None:
                    self.trace.span("copy", _label_run(run), issued_at, time.perf_counter())
                self._issued(run, region, n, event)
            if engine is not None:
                engine.restore_context()
            self.window.mark_captured_many(snap.spans)

    def _engine(self, device: torch.device, stream: Any) -> HostCopies | DriverCopies | None:
        """The by-address copy engine for this device's snapshot (closed when the window is),
        when the regions are page-locked host memory that stays (the fast tier's slabs); else
        None: copy through torch."""
        if not getattr(self.arena, "pinned", False) and device.type == "cuda":
            self.copy_path_why = ("its host memory is not page-locked (a staging arena, or fast-tier slabs the "
                                  "driver refused to register: stats['fast_register_errors'])")
            return None
        engine = address_copies(device, stream)
        if engine is not None:
            self._engines.append(engine)
            self.copy_path = "address"
        else:
            self.copy_path_why = "no by-address engine for this device (switched off, or a driver without it)"
        return engine

    def _allocate(self, n: int) -> Region:
        """A staging region for the next piece. Pieces in flight hold regions that only come
        back after this thread drains them, so a full arena first drains its own pieces (else a
        small arena would wait forever for releases that never come); only with nothing in
        flight does it wait for the writers."""
        while True:
            region = self.arena.try_allocate(n)  # grows the arena while it may
            if region is not None:
                return region
            if not self._inflight:
                return self.arena.allocate(n)
            if not self.arena.can_grow():
                self._drain(self._inflight_bytes - self._inflight[0][4])  # the oldest, at least

    def _issue(
        self, ws: WindowSpan, start: int, n: int, region: Region, stream: Any, held: set[str]
    ) -> Any:
        """Copy one piece; atomic with ``protect`` (see ``CaptureWindow.source``)."""
        issued_at = time.perf_counter()
        with self.window.cond:
            # (checked under the lock: once a program thread has failed the save, e.g. before
            # a resize it could not protect, no copy reads the live storage again)
            if self.window.error is not None:
                raise self.window.error
            src, from_shadow = self.window.source(ws, start, n)  # CheckpointError: a storage shrunk unseen
            if stream is None:
                region.data.copy_(src)  # CPU: done before the lock is released
                ws.issued = start + n
                if self.trace is not None:
                    self.trace.span("copy", _label(ws, start, n), issued_at, time.perf_counter())
                return None
            kind = "shadow" if from_shadow else "live"
            if kind not in held:
                if from_shadow and ws.shadow_event is not None:
                    stream.wait_event(ws.shadow_event)  # the shadow copy ran on the writer's stream
                src.record_stream(stream)  # its memory is not reused before our copies ran
                held.add(kind)
            region.data.copy_(src, non_blocking=True)
            if self.after_copy is not None:  # validation: hash what was just read, before the
                self.after_copy(ws, start, src)  # event that tracked writers wait for
            event = waitable_event()
            event.record(stream)
            if not from_shadow:
                ws.live_event = event
                ws.waited = None  # a newer event: writers must wait again
            ws.issued = start + n
        return event

    def _make_room(self, n: int) -> None:
        """Before issuing ``n`` more bytes: at most ``ahead - 1`` copies and
        ``max_inflight - n`` bytes may stay in flight (see the module docstring: with one
        piece ahead the copy stream runs dry before each issue)."""
        while len(self._inflight) >= self.ahead:  # the oldest, at least (max: even if empty)
            self._drain(self._inflight_bytes - max(1, self._inflight[0][4]))
        self._drain(self.max_inflight - n)

    def _drain(self, keep_bytes: int) -> None:
        """Wait until at most ``keep_bytes`` are in flight, then also take every piece whose
        copy has completed already; hand them to the sink as one batch (only this thread ever
        waits on copy events). A batch is cut at a piece's worth of bytes, so that the final
        drain still spreads over the writer threads."""
        batch: list[Piece] = []
        held = 0
        try:
            while self._inflight:
                event, issued_at, segments, region, n = self._inflight[0]
                if self._inflight_bytes > keep_bytes:
                    started = time.perf_counter()
                    wait_event(event)
                    self._traced("wait for a copy", started)
                    self.wait_s += time.perf_counter() - started
                elif not event.query():
                    break
                self._inflight.popleft()
                self._inflight_bytes -= n
                if self.trace is not None:
                    self.trace.span("copy", _label_run(segments), issued_at, time.perf_counter())
                batch.append((segments, region))
                held += n
                if held >= self.piece_bytes:
                    full, batch, held = batch, [], 0
                    self._hand_over(full)
        finally:
            if batch:
                self._hand_over(batch)

    def _hand_over(self, pieces: list[Piece]) -> None:
        """Give finished pieces to the sink; if it cannot take them, their regions come back."""
        try:
            self.sink(pieces)
        except BaseException:
            for _segments, region in pieces:
                self.arena.release(region)
            raise

    def _traced(self, what: str, started: float) -> None:
        if self.trace is not None:
            self.trace.span("copier", what, started, time.perf_counter())

    def _yield_to_program_copy(self) -> None:
        event = self.window.program_copy_event()
        if event is not None and not event.query():
            event.synchronize()


def _closed_sink(pieces: list[Piece]) -> None:
    raise RuntimeError("this copier has finished")


POLL_S: float | None = None  # None: wait with event.synchronize(); else poll with query()


def wait_event(event: Any) -> None:
    """Wait (without the GIL) until ``event`` has completed."""
    if POLL_S is None:
        event.synchronize()
        return
    while not event.query():
        time.sleep(POLL_S)


def _changed_runs(nbytes: int, skip: Collection[int], chunk_size: int, limit: int) -> Iterator[tuple[int, int]]:
    """(start, bytes) of each run of consecutive chunks not in ``skip`` (unchanged since the
    previous checkpoint), at most ``limit`` bytes each (whole chunks; a span's last chunk may
    be short)."""
    chunks = -(-nbytes // chunk_size)
    k = 0
    while k < chunks:
        if k in skip:
            k += 1
            continue
        j = k + 1
        while j < chunks and j not in skip and (j + 1 - k) * chunk_size <= limit:
            j += 1
        yield k * chunk_size, min(j * chunk_size, nbytes) - k * chunk_size
        k = j


def _adjacent_runs(segments: list[Segment], limit: int) -> Iterator[tuple[list[Segment], int, int]]:
    """Group segments (their last field: the position of their bytes in one buffer) that
    follow each other in the buffer, up to the padding that aligns each snapshot
    (``SNAPSHOT_ALIGN``), into runs of at most ``limit`` bytes: (segments with their offsets
    in the run, the run's position in the buffer, its bytes)."""
    run: list[Segment] = []
    base = end = 0
    for ws, start, n, pos in segments:
        if run and (not 0 <= pos - end < SNAPSHOT_ALIGN or pos + n - base > limit):
            yield run, base, end - base
            run = []
        if not run:
            base = pos
        run.append((ws, start, n, pos - base))
        end = pos + n
    if run:
        yield run, base, end - base


def _label_run(segments: list[Segment]) -> str:
    if len(segments) == 1:
        return _label(*segments[0][:3])
    return f"{len(segments)} spans ({sum(seg[2] for seg in segments)} B)"


def _label(ws: WindowSpan, start: int, n: int) -> str:
    name = ws.span.paths[0] if ws.span.paths else f"storage #{ws.index}"
    return f"{name} [{start}:{start + n}]"
