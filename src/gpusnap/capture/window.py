"""A capture window: the life cycle of every storage span of one concurrent save.

    pending --(copier issues its first piece)--> in flight --(last piece issued)--> captured
       \\--(program writes first)--> shadowed (copy-on-write) --(copier reads the shadow)--/

A span is copied in *pieces* (``Config.copy_piece_bytes``); ``issued`` counts the bytes whose
copies are enqueued (on CUDA: on the copy stream, each piece followed by an event; on CPU:
already copied, under the window's lock). A shadow covers only ``[shadow_from, nbytes)``, the
bytes not issued when the program first wrote the span.

Protection of a span before the program writes it (``protect``), in order of preference:
  1. captured, or the rest already shadowed: on CUDA the writing stream waits (on the device,
     not the CPU) for the event of the last piece issued from the live bytes;
  2. pending or in flight, and the copy-on-write budget allows the rest: shadow the bytes not
     yet issued, in the writer's stream order, and wait as in 1 for the issued pieces;
  3. otherwise (over budget): move it to the head of the queue and wait until every piece is
     issued (the CPU waits for the copier to *issue*; the writing stream then waits on the
     device for the copies).
The window closes once every copy has *completed* (not just been issued): after that the
tracker passes ops through and is removed at the next gpusnap call on its thread.

A forked child (``fork_safety``) has no copier: every window it inherits is closed there at
once (:meth:`CaptureWindow.after_fork_in_child`), so its writes wait for nothing. They reach
only the child's copy of memory, never the parent's checkpoint.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import compress
from typing import Any

import numpy as np
import torch

from gpusnap import fork_safety
from gpusnap.capture.trace import Trace
from gpusnap.capture.warmup import loading as kernels_loading
from gpusnap.errors import CheckpointError
from gpusnap.kernels.gather_copy import gather_copy, gather_copy_available, gather_copy_host, gather_copy_tensors
from gpusnap.state.flat import shrunk_storage_error
from gpusnap.state.flatten import FlatState, StorageSpan

__all__ = [
    "SNAPSHOT_ALIGN",
    "Allocate",
    "CaptureWindow",
    "SnapshotBuffer",
    "SpanState",
    "WindowSpan",
    "WindowStats",
    "buffers_from",
    "on_program_wait",
]


class SpanState(enum.Enum):
    PENDING = "pending"
    IN_FLIGHT = "in flight"
    CAPTURED = "captured"


@dataclass(eq=False, slots=True)  # one per storage per save: a cheap constructor matters
class WindowSpan:
    index: int
    span: StorageSpan
    key: int
    nbytes: int  # (copies of the span's, read in every loop over spans: no property calls)
    device: torch.device
    state: SpanState = SpanState.PENDING
    issued: int = 0  # bytes whose copies are enqueued (CPU: done)
    shadow: torch.Tensor | None = None  # holds bytes [shadow_from, nbytes) as they were at
    shadow_from: int = 0  # save(), from byte shadow_offset on: one buffer serves every span
    shadow_offset: int = 0  # copied with this one (no tensor per span)
    shadow_event: Any = None  # CUDA event after the shadow copy, on the writer's stream
    live_event: Any = None  # CUDA event after the last piece copied from the live bytes
    waited: set[int] | None = None  # streams already waiting on live_event (None: none yet;
    # not an empty set per span: every container a save keeps alive for seconds brings
    # Python's next full garbage collection, ~0.2 s in a big program, closer)
    urgent: bool = False
    cow: int = 0  # shadow bytes counted against the copy-on-write budget
    first_write: float | None = None
    first_touch: float | None = None



@dataclass
class WindowStats:
    bytes_cow: int = 0
    cow_events: int = 0
    cow_peak: int = 0
    waits: int = 0
    wait_s: float = 0.0
    stream_waits: int = 0
    ops_seen: int = 0
    opaque_launches: int = 0
    program_copies: int = 0
    cow_failures: int = 0  # shadows that found no memory: waited for instead


class CaptureWindow:
    """Shared state between the tracker (program threads) and the copier (its own thread)."""

    def __init__(
        self,
        flat: FlatState,
        *,
        order: Sequence[int],
        cow_budget: int,
        eager_cpu_bytes: int,
        trace: Trace | None = None,
        log_reads: bool = True,
        eager: Collection[int] = (),
        eager_device_bytes: int = 0,
        snapshot_budget: int = 0,
        snapshot_cpu_bytes: int = 0,
    ) -> None:
        self.flat = flat
        self.spans = [WindowSpan(i, s, s.storage._cdata, s.end - s.start, s.device) for i, s in enumerate(flat.spans)]
        self.by_key = {ws.key: ws for ws in self.spans}
        self.cond = threading.Condition()
        self.cow_budget = cow_budget
        self.cow_used = 0
        self.stats = WindowStats()
        self.trace = trace
        self.log_reads = log_reads or trace is not None  # every op's reads: costly, see tracker.py
        self.opened = time.perf_counter()
        self.closed_at: float | None = None
        self.error: BaseException | None = None
        self._queue = [self.spans[i] for i in order]
        self._urgent: list[WindowSpan] = []
        self._program_copy: Any = None  # CUDA event of the program's latest host<->device copy
        self._on_close: list[Callable[[], None]] = []
        self._waiting = 0  # program threads inside _wait_captured
        self.op_log: list[tuple[float, str, tuple[int, ...]]] = []
        self.bytes_eager = 0
        # Captured at the consistent point, with one batched copy per device: small spans
        # (cheaper than tracking and hashing each one: every launch costs the caller time),
        # spans written unseen by an earlier window (validation remembered them), and every
        # device span when each device's spans fit in ``snapshot_budget`` (a device copy of
        # the whole state costs the program a few ms of device time, where tracking every op
        # of a window costs its thread far more). If that copy finds no memory after all,
        # the window falls back to tracking.
        # Likewise every CPU span when they total at most ``snapshot_cpu_bytes``.
        per_device: dict[torch.device, int] = {}
        for ws in self.spans:
            per_device[ws.device] = per_device.get(ws.device, 0) + ws.nbytes
        cpu_bytes = per_device.pop(torch.device("cpu"), 0)
        whole_cpu = cpu_bytes <= snapshot_cpu_bytes
        whole_device = not per_device or max(per_device.values()) <= snapshot_budget

        live = [ws for ws in self.spans if ws.nbytes]

        def chosen(whole: bool) -> list[WindowSpan]:
            if whole and whole_cpu:  # every span (the usual save): no test per span
                return live
            return [
                ws for ws in self.spans
                if ws.nbytes and (
                    ws.index in eager
                    or (whole_cpu if ws.device.type == "cpu" else whole)
                    or ws.nbytes <= (eager_cpu_bytes if ws.device.type == "cpu" else eager_device_bytes)
                )
            ]

        snap = chosen(whole_device)
        started = time.perf_counter()
        try:
            self._snapshot(snap)
        except torch.cuda.OutOfMemoryError:
            if not whole_device or not per_device:
                raise
            for ws in snap:
                ws.shadow, ws.shadow_event = None, None
            snap = chosen(False)
            self._snapshot(snap)
        self.snapshot_s = time.perf_counter() - started  # host time of the snapshot copy
        self.bytes_eager = sum(ws.nbytes for ws in snap if ws.index in eager) if eager else 0
        self.bytes_snapshot = sum(ws.nbytes for ws in snap)
        self.snapshotted = frozenset(ws.index for ws in snap)
        # Nothing live left to protect: the program needs no tracker during this window.
        # (``snap`` holds distinct spans of ``live`` only)
        self.all_snapshotted = len(snap) == len(live)
        _open.add(self)

    # -- program side -------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self.closed_at is not None

    def touch(self, tensors: Iterable[torch.Tensor], written: Sequence[torch.Tensor], op: str) -> None:
        """Log the op (first touch per span of ``tensors``) and protect the spans it writes."""
        now = time.perf_counter()
        by_key = self.by_key
        hit: list[int] = []
        for t in tensors:
            try:
                found: Iterable[WindowSpan | None] = (by_key.get(t.untyped_storage()._cdata),)
            except Exception:  # no storage of its own (a sparse layout): its parts', if known
                found = self._spans_of(t) or ()
            for ws in found:
                if ws is not None:
                    hit.append(ws.index)
                    if ws.first_touch is None:
                        ws.first_touch = now
        self.stats.ops_seen += 1
        if hit:
            self.op_log.append((now - self.opened, op, tuple(hit)))
        if self.trace is not None:
            self.trace.instant("program", op, now)
        targets: list[WindowSpan] = []
        opaque = False
        for t in written:
            try:
                found = (by_key.get(t.untyped_storage()._cdata),)
            except Exception:
                spans = self._spans_of(t)
                if spans is None:  # it may write storages gpusnap cannot name: protect them all
                    opaque = True
                    continue
                found = spans
            for ws in found:
                if ws is not None:
                    if ws.first_write is None:
                        ws.first_write = now
                        if ws.first_touch is None:
                            ws.first_touch = now
                    targets.append(ws)
        if opaque:
            self.protect_all()
        elif targets:
            self.protect_many(targets)

    def _spans_of(self, tensor: torch.Tensor) -> list[WindowSpan] | None:
        """The window's spans among the storages of a tensor without one of its own (a
        sparse layout: its indices and values); None when they cannot be named."""
        try:
            parts = _storage_parts(tensor)
            if parts is None:
                return None
            keys = [p.untyped_storage()._cdata for p in parts]
        except Exception:
            return None
        return [ws for ws in map(self.by_key.get, keys) if ws is not None]

    def before_opaque_launch(self) -> None:
        """A ``launch_hooks`` listener: a launch the tracker cannot see is about to run."""
        if not self.closed:
            self.guarded(self.protect_all, "an opaque launch")

    def before_resize(self, storage: torch.UntypedStorage) -> None:
        """``storage.resize_`` is about to run, on any thread (``resize_guard``): a shrink
        frees bytes a pending span still has to copy, a growth moves them. Protect its span as
        for a write (under the lock, which the copier holds while it reads a piece), so the
        copier never reads the live storage again."""
        if not self.closed:
            self.guarded(lambda: self._protect_storage(storage), "UntypedStorage.resize_")

    def _protect_storage(self, storage: torch.UntypedStorage) -> None:
        ws = self.by_key.get(storage._cdata)
        if ws is not None:
            self.protect_many((ws,))

    def guarded(self, work: Callable[[], None], what: str) -> None:
        """Run gpusnap's bookkeeping for the program's ``what``: an exception in it fails the
        save, never the program (an interrupt still reaches the program, and fails the save)."""
        try:
            work()
        except Exception as exc:
            self.fail(bookkeeping_error(what, exc))
        except BaseException as exc:  # KeyboardInterrupt: the protection may be half done
            self.fail(bookkeeping_error(what, exc))
            raise

    def fail(self, error: BaseException) -> None:
        """gpusnap cannot keep its promise for some op of the program: the save fails with
        ``error`` (the copier stops at its next piece and closes the window), and nothing is
        protected any more; the program goes on. After the window has closed every byte is
        captured already: nothing can fail then."""
        with self.cond:
            if self.error is None and self.closed_at is None:
                self.error = error
            self.cond.notify_all()

    def protect_all(self) -> None:
        """An opaque launch (CUDA graph replay, hand-launched kernel) may write anything."""
        self.stats.opaque_launches += 1
        self.protect_many(self.spans)

    def protect(self, ws: WindowSpan) -> None:
        """Make the program's coming write to ``ws`` safe for the checkpoint."""
        self.protect_many([ws])

    def protect_many(self, targets: Sequence[WindowSpan]) -> None:
        """Make the program's coming writes to ``targets`` safe (one batched shadow copy)."""
        with self.cond:
            if self.error is not None or self.closed_at is not None:
                return  # the save failed (nothing to keep), or every copy has completed
            to_shadow: list[WindowSpan] = []
            to_wait: list[WindowSpan] = []
            seen: set[int] = set()
            for ws in targets:
                if ws.state is SpanState.CAPTURED or ws.shadow is not None or ws.index in seen:
                    continue
                seen.add(ws.index)
                have = ws.span.storage.nbytes()
                if have < ws.span.end:  # shrunk or freed unseen: its bytes are gone
                    for counted in to_shadow:
                        self.cow_used -= counted.cow
                        counted.cow = 0
                    self.fail(shrunk_storage_error(ws.span.paths, ws.span.end, have))
                    return
                rest = ws.nbytes - ws.issued
                if self.cow_used + rest <= self.cow_budget:
                    to_shadow.append(ws)
                    self.cow_used += rest
                    ws.cow = rest
                else:
                    to_wait.append(ws)
            if to_shadow:  # first, while no lock release can let the copier move on
                to_wait += self._shadow_or_wait(to_shadow)
            for ws in to_wait:
                self._wait_captured(ws)
            events = [(ws, ws.live_event) for ws in targets if ws.live_event is not None]
        for ws, event in events:
            stream = torch.cuda.current_stream(ws.device)
            if ws.waited is None or stream.stream_id not in ws.waited:  # one wait per stream
                stream.wait_event(event)
                ws.waited = {stream.stream_id} if ws.waited is None else ws.waited | {stream.stream_id}
                self.stats.stream_waits += 1

    def _snapshot(self, spans: list[WindowSpan]) -> None:
        """Whole-span shadows taken now, on the current streams (not counted as COW)."""
        self._snapshot_buffers: list[SnapshotBuffer] = []
        # (flatten has just checked every storage's size, and no code of the program ran on
        # this thread since: the snapshot may copy by address)
        for _device, group, buffer, offsets, event in _batched_copies(spans):
            for ws, offset in zip(group, offsets):
                ws.shadow, ws.shadow_offset, ws.shadow_from, ws.shadow_event = buffer, offset, 0, event
            self._snapshot_buffers.append(SnapshotBuffer(group, buffer, offsets))

    def snapshot_buffers(self) -> list[SnapshotBuffer]:
        """Per device, the buffer that holds the snapshots (it keeps them alive)."""
        return list(self._snapshot_buffers)

    def _shadow_or_wait(self, spans: list[WindowSpan]) -> list[WindowSpan]:
        """Shadow ``spans``; those whose shadow found no memory give their budget back and
        are returned, to be waited for instead (the program's op must not fail for it)."""
        try:
            self._shadow_many(spans)
        except torch.OutOfMemoryError:
            self.stats.cow_failures += 1
        unshadowed = [ws for ws in spans if ws.shadow is None]
        for ws in unshadowed:
            self.cow_used -= ws.cow
            ws.cow = 0
        return unshadowed

    def _shadow_many(self, spans: list[WindowSpan]) -> None:
        """Copy the bytes not yet issued of each span, on the writer's stream (so before its
        write); spans on one device share one buffer and one multi-tensor copy kernel. No
        dispatch mode sees these copies (the tracker's, when an opaque launch or a resize
        protects from outside an op, or the program's own): they are gpusnap's.
        The caller has checked, under the lock, that each storage still holds its span."""
        started = time.perf_counter()
        with torch._C._DisableTorchDispatch():
            for _device, group, buffer, offsets, event in _batched_copies(spans):
                for ws, offset in zip(group, offsets):
                    ws.shadow, ws.shadow_offset, ws.shadow_from, ws.shadow_event = buffer, offset, ws.issued, event
                    self.stats.bytes_cow += ws.cow
                    self.stats.cow_events += 1
        self.stats.cow_peak = max(self.stats.cow_peak, self.cow_used)
        if self.trace is not None:
            nbytes = sum(ws.cow for ws in spans)
            self.trace.span("cow", f"shadow {len(spans)} spans ({nbytes} B)", started, time.perf_counter())

    def _wait_captured(self, ws: WindowSpan) -> None:
        started = time.perf_counter()
        if ws.state is not SpanState.CAPTURED and not ws.urgent:
            ws.urgent = True
            self._urgent.append(ws)
            self.cond.notify_all()
        if _wait_listeners and ws.state is not SpanState.CAPTURED and self.error is None:
            for listener in _wait_listeners[:]:  # (a copy: a listener may leave meanwhile)
                listener()
        self._waiting += 1
        try:
            while ws.state is not SpanState.CAPTURED and self.error is None:  # (a failed save: no wait)
                self.cond.wait()
        finally:
            self._waiting -= 1
            self.stats.waits += 1
            self.stats.wait_s += time.perf_counter() - started
            self.cond.notify_all()
        if self.trace is not None:
            self.trace.span("wait", f"wait {_name(ws)}", started, time.perf_counter())

    def program_copy(self, event: Any) -> None:
        """The program issued its own host<->device copy: no new piece until it is done."""
        self.stats.program_copies += 1
        self._program_copy = event

    # -- copier side ---------------------------------------------------------------------------
    def take_next(self) -> WindowSpan | None:
        """The next span to copy (urgent first, then in order), marked in flight; None: done."""
        with self.cond:
            for source in (self._urgent, self._queue):
                while source:
                    ws = source.pop(0)
                    if ws.state is SpanState.PENDING:
                        ws.state = SpanState.IN_FLIGHT
                        return ws
            return None

    def program_copy_event(self) -> Any:
        return self._program_copy

    def skip_to(self, ws: WindowSpan, end: int) -> None:
        """Bytes before ``end`` need no copy (unchanged since the previous checkpoint)."""
        with self.cond:
            ws.issued = max(ws.issued, end)

    def source(self, ws: WindowSpan, start: int, n: int) -> tuple[torch.Tensor, bool]:
        """Bytes ``[start, start+n)`` of ``ws`` as of save(); True when read from the shadow.

        Call with ``cond`` held, and enqueue the copy before releasing it: ``protect`` decides
        what to shadow from ``issued``, so issuing must be atomic with the decision.
        """
        if ws.shadow is not None and start >= ws.shadow_from:
            off = ws.shadow_offset + start - ws.shadow_from
            return ws.shadow[off : off + n], True
        return ws.span.as_bytes()[start : start + n], False

    def mark_captured(self, ws: WindowSpan) -> None:
        self.mark_captured_many((ws,))

    def mark_captured_many(self, spans: Iterable[WindowSpan]) -> None:
        """Each of ``spans`` is captured (one lock round and one wake-up for them all: a
        snapshot window marks a model's thousands of spans at once, on a thread that
        competes with the program for the GIL)."""
        with self.cond:
            for ws in spans:
                ws.state = SpanState.CAPTURED
                self.cow_used -= ws.cow  # the shadow's memory goes back to the budget
                ws.cow = 0
                ws.shadow = None
                ws.span.tensors.clear()  # (the span's ``storage`` still holds the memory until the save is done)
            self.cond.notify_all()

    def on_close(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` (once, on the closing thread) when the window closes."""
        self._on_close.append(callback)

    def close(self, error: BaseException | None = None) -> None:
        """Every copy completed (or the save failed): release every waiter."""
        with self.cond:
            if error is not None and self.error is None:
                self.error = error
            if self.closed_at is not None:
                return
            for ws in self.spans:
                if ws.state is not SpanState.CAPTURED:
                    ws.state = SpanState.CAPTURED
                    ws.shadow = None
                    ws.cow = 0
            self.cow_used = 0  # every shadow is gone
            # the snapshots' memory goes back now (a save that hashes them after the window
            # holds its own references until then)
            self._snapshot_buffers = []
            self.closed_at = time.perf_counter()
            self.cond.notify_all()
        _open.discard(self)
        callbacks, self._on_close = self._on_close, []  # run once; and they are bound
        _run_all(callbacks)  # methods of the save, which holds this window: no cycle

    def after_fork_in_child(self) -> None:
        """In a forked child: no copier runs here, so close the window (its writes then wait
        for nothing), under a new lock (the copier may have held this one at the fork)."""
        self.cond = threading.Condition()
        self._waiting = 0  # (the parent's waiting threads are not in the child)
        if not self.closed:
            self.close(CheckpointError("this process was forked from the one that took this checkpoint: "
                                       "the checkpoint is the parent's, and only the parent finishes it"))

    def settle(self) -> None:
        """After close: wait until no program thread is still leaving a wait (so that the
        stats read next are complete)."""
        with self.cond:
            while self._waiting:
                self.cond.wait()

    def write_order(self) -> list[str]:
        """Key paths of written spans, soonest first: the next save copies these first."""
        written = sorted((ws for ws in self.spans if ws.first_write is not None), key=lambda w: w.first_write)
        return [ws.span.paths[0] for ws in written if ws.span.paths]

    def access_order(self) -> list[int]:
        """Span indices in the order the program first touched them during the window."""
        touched = sorted((ws for ws in self.spans if ws.first_touch is not None), key=lambda w: w.first_touch)
        return [ws.index for ws in touched]


_open: weakref.WeakSet[CaptureWindow] = weakref.WeakSet()  # windows not closed yet


def _close_in_child() -> None:
    for window in list(_open):
        window.after_fork_in_child()


fork_safety.at_fork(after_in_child=_close_in_child)


class SnapshotBuffer:
    """One device's snapshots, back to back in one buffer: ``spans[i]``'s bytes are
    ``buffer[offsets[i] : offsets[i] + spans[i].nbytes]``. Holding it keeps them all alive."""

    def __init__(self, spans: list[WindowSpan], buffer: torch.Tensor, offsets: list[int]) -> None:
        self.spans = spans
        self.buffer = buffer
        self.offsets = offsets  # byte offset of each span's snapshot in ``buffer``


SNAPSHOT_ALIGN = 16  # each shadow starts 16-byte aligned in its buffer: the hash kernels'
# wide loads need it (an unaligned input is hashed from a copy)


def _batched_copies(
    spans: list[WindowSpan],
) -> Iterator[tuple[torch.device, list[WindowSpan], torch.Tensor, list[int], Any]]:
    """Per device: the spans, one buffer holding copies of their bytes not yet issued (each
    at its offset, aligned to ``SNAPSHOT_ALIGN``), those offsets, and a CUDA event after the
    copy, which runs on the current stream.

    On CUDA with Triton the copy is one kernel fed by the spans' addresses
    (``kernels.gather_copy``): no tensor per span, which was most of ``save()``'s host time
    after ``flatten`` for a model's thousands of storages; while that kernel still loads
    (``capture/warmup.py``), torch's copies, as without Triton. On the CPU, a ``memmove`` per small
    span (an optimizer's scalar ``step`` tensors), one ``_foreach_copy_`` of the others, from a
    uint8 alias of each; the same on CUDA without Triton.

    A copy by address trusts that each storage still holds ``span.end`` bytes: the caller has
    checked it (``save()``: ``flatten``, right before; a copy-on-write shadow: ``protect_many``,
    under the lock), else a storage the program shrank (``resize_(0)``, as FSDP does with its
    parameters' storages) would be read past its end: freed memory."""
    by_device: dict[torch.device, list[WindowSpan]] = {}
    for ws in spans:
        by_device.setdefault(ws.device, []).append(ws)
    for device, group in by_device.items():
        sizes = np.fromiter((ws.nbytes - ws.issued for ws in group), dtype=np.int64, count=len(group))
        padded = sizes + (-sizes % SNAPSHOT_ALIGN)
        offsets = np.cumsum(padded) - padded
        buffer = _new_buffer(int(padded.sum()), device)
        if gather_copy_available(device) and not kernels_loading(device):
            gather_copy(buffer, offsets, _addresses(group), sizes)
        elif device.type == "cpu":  # tiny spans by address; big ones by torch
            small = sizes <= _HOST_MOVE_MAX
            if small.any():
                picked = list(compress(group, small))
                gather_copy_host(buffer, offsets[small], _addresses(picked), sizes[small])
            if not small.all():
                big = ~small
                gather_copy_tensors(buffer, offsets[big].tolist(), _sources(compress(group, big)))
        else:
            gather_copy_tensors(buffer, offsets.tolist(), _sources(group))
        event = None
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        yield device, group, buffer, offsets.tolist(), event


_HOST_MOVE_MAX = 256 << 10  # CPU spans up to this are snapshotted by memmove (see gather_copy_host)


def _new_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """The buffer of one device's snapshots or shadows (``torch.OutOfMemoryError`` when the
    device has no room: a snapshot then falls back to tracking, a shadow to a wait)."""
    return _allocate(nbytes, device)


# -- seams: what a test (or a diagnostic tool) may observe or replace, process-wide ---------------
Allocate = Callable[[int, torch.device], torch.Tensor]  # (nbytes, device) -> a uint8 tensor of nbytes


def _empty(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


_allocate: Allocate = _empty
_wait_listeners: list[Callable[[], None]] = []


@contextlib.contextmanager
def buffers_from(allocate: Allocate) -> Iterator[None]:
    """Within the block, every snapshot and copy-on-write shadow buffer comes from
    ``allocate(nbytes, device)`` instead of ``torch.empty``: fault injection (raising
    ``torch.OutOfMemoryError`` takes the path of a device without room: a snapshot falls back
    to tracking, a shadow to a wait), or a watch on the buffers' lifetime."""
    global _allocate
    previous, _allocate = _allocate, allocate
    try:
        yield
    finally:
        _allocate = previous


@contextlib.contextmanager
def on_program_wait(listener: Callable[[], None]) -> Iterator[None]:
    """Within the block, ``listener()`` runs whenever a program thread is about to block until
    the copier has issued a span (over the copy-on-write budget, or a shadow without memory).
    It runs on that thread, under the window's lock: it must not block or call gpusnap. A test
    that holds a save's writers lets them go there (the copier waits for their staging)."""
    _wait_listeners.append(listener)
    try:
        yield
    finally:
        _wait_listeners.remove(listener)


def _storage_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The tensors holding the bytes of a tensor without a storage of its own (sparse
    layouts); None for any other kind."""
    layout = tensor.layout
    if layout is torch.sparse_coo:
        return tensor._indices(), tensor._values()
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return tensor.crow_indices(), tensor.col_indices(), tensor.values()
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return tensor.ccol_indices(), tensor.row_indices(), tensor.values()
    return None


def bookkeeping_error(what: str, exc: BaseException) -> CheckpointError:
    """The save's error when gpusnap's own work for the program's ``what`` failed."""
    error = CheckpointError(
        f"gpusnap could not protect the checkpoint from the program's {what} ({exc!r}); "
        "the program went on, this checkpoint was not committed"
    )
    error.__cause__ = exc
    return error


def _addresses(group: list[WindowSpan]) -> np.ndarray:
    """Each span's first byte not yet issued, by address (the spans keep their storages alive)."""
    return np.fromiter((ws.span.storage.data_ptr() + ws.span.start + ws.issued for ws in group),
                       dtype=np.int64, count=len(group))


def _sources(group: Iterable[WindowSpan]) -> list[torch.Tensor]:
    """Each span's bytes not yet issued, as a uint8 alias."""
    return [ws.span.as_bytes()[ws.issued :] if ws.issued else ws.span.as_bytes() for ws in group]


def _name(ws: WindowSpan) -> str:
    return ws.span.paths[0] if ws.span.paths else f"storage #{ws.index}"


def _run_all(callbacks: list[Callable[[], None]]) -> None:
    """Each callback runs even if one before it raised (or was interrupted): one of them may
    be the resize guard's unwatch, which must never be skipped. The first error is raised."""
    if not callbacks:
        return
    try:
        callbacks[0]()
    finally:
        _run_all(callbacks[1:])

