"""The copy engine: moves every span of a window off its device, chunk by chunk.

One named thread per window walks the spans in priority order (``CaptureWindow.take_next``),
copies each chunk into a staging slot (on CUDA: on a low-priority stream, after the
consistent-point event, as an async copy followed by an event), and hands the slot to the
``sink`` (hash + store, on writer threads), which releases it. While the program has a
host<->device copy of its own in flight, no new chunk is issued.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from gpusnap.capture.staging import StagingPool
from gpusnap.capture.window import CaptureWindow, WindowSpan

__all__ = ["Copier", "ChunkSink"]

# sink(span, chunk_index, slot, nbytes, event_or_None); must release the slot to the pool.
ChunkSink = Callable[[WindowSpan, int, torch.Tensor, int, Any], None]


class Copier:
    def __init__(
        self,
        window: CaptureWindow,
        pool: StagingPool,
        sink: ChunkSink,
        *,
        chunk_size: int,
        consistent_events: dict[torch.device, Any],
        streams: dict[torch.device, Any],
    ) -> None:
        if chunk_size > pool.slot_bytes:
            raise ValueError("a staging slot must hold a whole chunk")
        self.window = window
        self.pool = pool
        self.sink = sink
        self.chunk_size = chunk_size
        self.events = consistent_events
        self.streams = streams
        self.thread = threading.Thread(target=self._run, name="gpusnap-copier", daemon=True)

    def start(self) -> None:
        for device, stream in self.streams.items():
            stream.wait_event(self.events[device])  # copies read the state as of save()
        self.thread.start()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def _run(self) -> None:
        try:
            while (ws := self.window.take_next()) is not None:
                self._copy_span(ws)
                self.window.mark_captured(ws)
            self.window.close()
        except BaseException as exc:  # the save fails; the program must not wait forever
            self.window.close(exc)

    def _copy_span(self, ws: WindowSpan) -> None:
        src = ws.shadow if ws.shadow is not None else ws.span.as_bytes()
        stream = self.streams.get(ws.device) if ws.device.type == "cuda" else None
        if stream is not None and ws.shadow_event is not None:
            stream.wait_event(ws.shadow_event)
        event = None
        for k, start in enumerate(range(0, ws.nbytes, self.chunk_size)):
            if self.window.error is not None:
                raise self.window.error
            n = min(self.chunk_size, ws.nbytes - start)
            self._yield_to_program_copy()
            slot = self.pool.acquire()
            try:
                if stream is None:
                    slot[:n].copy_(src[start : start + n])
                else:
                    with torch.cuda.stream(stream):
                        slot[:n].copy_(src[start : start + n], non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(stream)
            except BaseException:
                self.pool.release(slot)
                raise
            self.sink(ws, k, slot, n, event)
        if stream is not None:
            src.record_stream(stream)  # its memory is not reused before the copies ran
            ws.done_event = event

    def _yield_to_program_copy(self) -> None:
        event = self.window.program_copy_event()
        if event is not None and not event.query():
            event.synchronize()
