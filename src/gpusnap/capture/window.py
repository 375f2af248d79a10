"""A capture window: the life cycle of every storage span of one concurrent save.

    pending --(copier takes it)--> in_flight --(bytes copied off)--> captured
       \\--(program writes first)--> shadowed (copy-on-write) --(copier copies the shadow)--> captured

Protection of a pending span before a write (``protect``), in order of preference:
  1. already captured: on CUDA the writing stream waits for the span's copy event;
  2. already shadowed: nothing to do, the copier reads the shadow;
  3. pending and the copy-on-write budget allows: shadow it now, in the writer's stream order;
  4. otherwise (over budget, or its chunks are in flight): move it to the head of the queue
     and wait until its bytes are copied off (the CPU waits for the copier to *issue* the
     copies; the writing stream then waits for them on the device).
The window is open until every span is captured; then the tracker passes ops through and is
removed at the next gpusnap call on its thread.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gpusnap.state.flatten import FlatState, StorageSpan

__all__ = ["SpanState", "WindowSpan", "CaptureWindow", "WindowStats"]


class SpanState(enum.Enum):
    PENDING = "pending"
    IN_FLIGHT = "in flight"
    CAPTURED = "captured"


@dataclass(eq=False)
class WindowSpan:
    index: int
    span: StorageSpan
    key: int
    state: SpanState = SpanState.PENDING
    shadow: torch.Tensor | None = None  # copy-on-write (or eagerly captured) bytes
    shadow_event: Any = None  # CUDA event after the shadow copy, on the writer's stream
    done_event: Any = None  # CUDA event after the span's last chunk copy, on the copy stream
    urgent: bool = False
    cow: bool = False  # the shadow counts against the copy-on-write budget
    first_write: float | None = None
    first_touch: float | None = None

    @property
    def nbytes(self) -> int:
        return self.span.nbytes

    @property
    def device(self) -> torch.device:
        return self.span.device


@dataclass
class WindowStats:
    bytes_cow: int = 0
    cow_events: int = 0
    waits: int = 0
    wait_s: float = 0.0
    ops_seen: int = 0
    opaque_launches: int = 0
    program_copies: int = 0


class CaptureWindow:
    """Shared state between the tracker (program threads) and the copier (its own thread)."""

    def __init__(
        self,
        flat: FlatState,
        *,
        order: Sequence[int],
        cow_budget: int,
        eager_cpu_bytes: int,
    ) -> None:
        self.flat = flat
        self.spans = [WindowSpan(i, s, s.storage._cdata) for i, s in enumerate(flat.spans)]
        self.by_key = {ws.key: ws for ws in self.spans}
        self.cond = threading.Condition()
        self.cow_budget = cow_budget
        self.cow_used = 0
        self.stats = WindowStats()
        self.opened = time.perf_counter()
        self.closed_at: float | None = None
        self.error: BaseException | None = None
        self._queue = [self.spans[i] for i in order]
        self._urgent: list[WindowSpan] = []
        self._program_copy: Any = None  # CUDA event of the program's latest host<->device copy
        self.op_log: list[tuple[float, str, tuple[int, ...]]] = []
        for ws in self.spans:  # small CPU spans: captured at the consistent point (cheaper)
            if ws.device.type == "cpu" and ws.nbytes <= eager_cpu_bytes:
                ws.shadow = ws.span.as_bytes().clone()

    # -- program side -------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self.closed_at is not None

    def touch(self, tensors: Iterable[torch.Tensor], written: Sequence[torch.Tensor], op: str) -> None:
        """Log the op (first touch per span) and protect the spans it writes."""
        now = time.perf_counter()
        hit: list[int] = []
        for t in tensors:
            ws = self.by_key.get(t.untyped_storage()._cdata)
            if ws is not None:
                hit.append(ws.index)
                if ws.first_touch is None:
                    ws.first_touch = now
        self.stats.ops_seen += 1
        if hit:
            self.op_log.append((now - self.opened, op, tuple(hit)))
        for t in written:
            ws = self.by_key.get(t.untyped_storage()._cdata)
            if ws is not None:
                if ws.first_write is None:
                    ws.first_write = now
                self.protect(ws)

    def protect_all(self) -> None:
        """An opaque launch (CUDA graph replay, hand-launched kernel) may write anything."""
        self.stats.opaque_launches += 1
        for ws in self.spans:
            self.protect(ws)

    def protect(self, ws: WindowSpan) -> None:
        with self.cond:
            if ws.state is SpanState.CAPTURED or ws.shadow is not None:
                pass
            elif ws.state is SpanState.PENDING and self.cow_used + ws.nbytes <= self.cow_budget:
                self._shadow(ws)
                return
            else:
                self._wait_captured(ws)
        if ws.done_event is not None and ws.device.type == "cuda":
            torch.cuda.current_stream(ws.device).wait_event(ws.done_event)

    def _shadow(self, ws: WindowSpan) -> None:
        src = ws.span.as_bytes()
        ws.shadow = src.clone()  # on the writer's current stream: ordered before the write
        if ws.device.type == "cuda":
            ws.shadow_event = torch.cuda.Event()
            ws.shadow_event.record(torch.cuda.current_stream(ws.device))
        ws.cow = True
        self.cow_used += ws.nbytes
        self.stats.bytes_cow += ws.nbytes
        self.stats.cow_events += 1

    def _wait_captured(self, ws: WindowSpan) -> None:
        started = time.perf_counter()
        if ws.state is SpanState.PENDING and not ws.urgent:
            ws.urgent = True
            self._urgent.append(ws)
            self.cond.notify_all()
        while ws.state is not SpanState.CAPTURED:
            self.cond.wait()
        self.stats.waits += 1
        self.stats.wait_s += time.perf_counter() - started

    def program_copy(self, event: Any) -> None:
        """The program issued its own host<->device copy: no new chunk until it is done."""
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

    def has_urgent(self) -> bool:
        return bool(self._urgent)

    def program_copy_event(self) -> Any:
        return self._program_copy

    def mark_captured(self, ws: WindowSpan) -> None:
        with self.cond:
            ws.state = SpanState.CAPTURED
            if ws.cow:
                self.cow_used -= ws.nbytes  # the shadow's memory goes back to the budget
                ws.cow = False
            ws.shadow = None
            ws.span.tensors.clear()  # the live storage may be freed now (copies hold the stream)
            self.cond.notify_all()

    def close(self, error: BaseException | None = None) -> None:
        """Every span captured (or the save failed): release every waiter."""
        with self.cond:
            if error is not None and self.error is None:
                self.error = error
            for ws in self.spans:
                if ws.state is not SpanState.CAPTURED:
                    ws.state = SpanState.CAPTURED
                    ws.shadow = None
            self.closed_at = time.perf_counter()
            self.cond.notify_all()

    def write_order(self) -> list[str]:
        """Key paths of written spans, soonest first: the next save copies these first."""
        written = sorted((ws for ws in self.spans if ws.first_write is not None), key=lambda w: w.first_write)
        return [ws.span.paths[0] for ws in written if ws.span.paths]

    def access_order(self) -> list[int]:
        touched = sorted((ws for ws in self.spans if ws.first_touch is not None), key=lambda w: w.first_touch)
        return [ws.index for ws in touched]
