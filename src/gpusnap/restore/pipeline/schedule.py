"""Which piece loads next, and the life cycle of each span during a restore.

    pending --(a reader takes its first piece)--> loading --(every piece applied)--> loaded

A *piece* is up to ``piece_chunks`` consecutive chunks of one span: read with as few system
calls as the pack layout allows, staged in one host region and copied with one device copy,
so the per-piece Python work is paid per tens of MiB rather than per chunk. Readers take
pieces, not spans, so that several threads share one large span. Spans the program is
waiting for (``urgent``) go before the rest, most recent request first; the rest follow
``order``. After a failure no new piece is handed out; once the loader has stopped,
:meth:`Schedule.close` wakes every waiter, and those whose span is not loaded get the error.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import torch

from gpusnap.errors import CheckpointError

__all__ = ["BATCH_ALIGN", "LoadSpan", "Piece", "Schedule", "SpanState"]

BATCH_ALIGN = 256  # byte alignment of each span in a batch's region (hash kernels, wide copies)
BATCH_LOOKAHEAD = 64  # spans of the load order a batch looks at, at most
BATCH_SKIP = 16  # spans of another kind a batch passes over, at most (they load next)


class SpanState(enum.Enum):
    PENDING = "pending"
    LOADING = "loading"
    LOADED = "loaded"


@dataclass(eq=False)
class LoadSpan:
    """One stored span on its way into its targets."""

    index: int
    nbytes: int
    chunks: int
    streamed: bool  # applied piece by piece (apply_bytes.apply_range), else as a whole
    devices: frozenset[torch.device]
    device_check: bool = False  # verified on the device against StorageEntry.hashes (pipeline.device_check)
    checkable: bool = False  # could be: a small span is, when it shares a batch (Schedule.take_batch)
    state: SpanState = SpanState.PENDING
    next_chunk: int = 0  # the first chunk of the next piece to hand to a reader
    left: int = 0  # chunks not yet applied (streamed) or read (whole)
    applied_bytes: int = 0  # bytes already written into the targets
    buffer: torch.Tensor | None = field(default=None, repr=False)  # whole span, host
    ready: tuple[tuple[torch.device, Any], ...] = ()  # (device, CUDA event): copies done once it passes
    urgent: bool = False
    first_needed: float | None = None  # perf_counter of the program's first touch

    def __post_init__(self) -> None:
        self.left = self.chunks

    @property
    def cuda(self) -> bool:
        return any(d.type == "cuda" for d in self.devices)


@dataclass(frozen=True, eq=False)
class Piece:
    """Chunks ``[first, first + count)`` of ``span``: bytes ``[offset, offset + nbytes)`` of it."""

    span: LoadSpan
    first: int
    count: int
    offset: int
    nbytes: int


class Schedule:
    """Shared by the readers (``take``), the copy thread (``piece_done``/``mark_loaded``) and
    the program (``wait``)."""

    def __init__(
        self,
        spans: Sequence[LoadSpan],
        order: Iterable[int],
        *,
        chunk_size: int,
        piece_chunks: int,
        join_checks: bool = True,
    ) -> None:
        if piece_chunks < 1:
            raise ValueError("a piece holds at least one chunk")
        self.spans = list(spans)
        self.join_checks = join_checks  # checkable spans batch together, all checked on the device
        self.chunk_size = chunk_size
        self.piece_chunks = piece_chunks
        self.cond = threading.Condition()
        self.error: BaseException | None = None  # first failure: no new piece is handed out
        self.closed = False  # loader stopped (all loaded, or failed)
        self.final_error: BaseException | None = None
        # run on each span just before it counts as loaded: an error keeps it unloaded and
        # fails the load (a lazy restore's gate: a write it never saw, Gate.unseen_write)
        self.check: Callable[[LoadSpan], BaseException | None] | None = None
        self._queue = deque(self.spans[i] for i in order)
        self._urgent: deque[LoadSpan] = deque()
        self._loaded = 0
        for ls in self.spans:
            if ls.chunks == 0:
                ls.state = SpanState.LOADED
                self._loaded += 1

    # -- readers -------------------------------------------------------------------------------
    def take(self) -> Piece | None:
        """The next piece to load; None when none is left (or the load failed)."""
        with self.cond:
            return self._take_locked()

    def take_batch(self, room: int, max_chunks: int) -> list[tuple[Piece, int]]:
        """The next piece at offset 0, plus the *whole* spans that follow it in the load order
        while they fit in ``room`` bytes and ``max_chunks`` chunks, each at a
        :data:`BATCH_ALIGN`-aligned offset; empty when nothing is left.

        Batched spans share the first one's kind (streamed, same devices, same check), so one
        host region, one device copy and one hash launch serve them all: GPT-2 large has ~1700
        spans, most far smaller than a piece, and the per-piece work of the copy thread
        bounded the restore at 6.7 GB/s. Nothing is batched while the program
        waits for a span (``urgent``): a batch would delay it.

        A batch passes over a few spans of another kind (:data:`BATCH_SKIP`; they go in the
        next batch): in an AdamW state, each parameter's CPU ``step`` counter sits between its
        two GPU moments, and ended every batch after one tensor (1111 batches for GPT-2
        large's 1765 pieces).

        Spans that *could* be checked on the device (``checkable``) count as one kind
        (``join_checks``): a small span, which alone keeps BLAKE2b on the host (one hash
        launch for it costs more), joins its device-checked neighbours, and every member of
        such a batch is then checked on the device; a batch of small spans only stays on the
        host. Without this, the small biases and norms between a model's weight matrices
        break the batches: GPT-2 large's load order made 720 batches of 32 MiB regions,
        against 356 with it.
        """
        with self.cond:
            first = self._take_locked()
            if first is None:
                return []
            batch = [(first, 0)]
            head = first.span
            if self._urgent or not head.streamed or first.first or first.count != head.chunks:
                return batch
            end, chunks = first.nbytes, first.count
            joining = self.join_checks and head.checkable
            skipped = 0
            for ls in list(islice(self._queue, BATCH_LOOKAHEAD)):  # taken spans stay until they reach the head
                if ls.next_chunk >= ls.chunks:  # taken already (or nothing to load)
                    continue
                if (
                    ls.next_chunk
                    or not ls.streamed
                    or ls.devices != head.devices
                    or not (ls.checkable if joining else ls.device_check == head.device_check)
                ):
                    # another kind (an optimizer's CPU step counter between two GPU moments):
                    # left for the next batch, so that it does not end this one
                    skipped += 1
                    if skipped > BATCH_SKIP:
                        break
                    continue
                offset = -(-end // BATCH_ALIGN) * BATCH_ALIGN
                if offset + ls.nbytes > room or chunks + ls.chunks > max_chunks:
                    break  # large spans keep their place in the order
                ls.next_chunk = ls.chunks
                ls.state = SpanState.LOADING
                batch.append((Piece(ls, 0, ls.chunks, 0, ls.nbytes), offset))
                end, chunks = offset + ls.nbytes, chunks + ls.chunks
            if joining and len(batch) > 1 and any(p.span.device_check for p, _ in batch):
                for piece, _ in batch:  # decided before any reader reads them
                    piece.span.device_check = True
            return batch

    def _take_locked(self) -> Piece | None:
        if self.error is not None:
            return None
        for source in (self._urgent, self._queue):
            while source:
                ls = source[0]
                if ls.next_chunk >= ls.chunks:
                    source.popleft()
                    continue
                k = ls.next_chunk
                count = min(self.piece_chunks, ls.chunks - k)
                ls.next_chunk += count
                if ls.state is SpanState.PENDING:
                    ls.state = SpanState.LOADING
                offset = k * self.chunk_size
                return Piece(ls, k, count, offset, min(ls.nbytes, offset + count * self.chunk_size) - offset)
        return None

    def piece_done(self, piece: Piece, applied: int) -> bool:
        """``piece`` is through (``applied`` bytes written); True when it was its span's last."""
        with self.cond:
            ls = piece.span
            ls.applied_bytes += applied
            ls.left -= piece.count
            return ls.left == 0

    def mark_loaded(self, ls: LoadSpan, ready: Sequence[tuple[torch.device, Any]]) -> None:
        self.mark_loaded_many([(ls, ready)])

    def mark_loaded_many(self, spans: Sequence[tuple[LoadSpan, Sequence[tuple[torch.device, Any]]]]) -> None:
        """Each span is loaded; ``ready``: (device, event) its users' streams must wait for.

        A span that fails :attr:`check` stays unloaded and fails the load (its error first).
        """
        check = self.check
        with self.cond:
            for ls, ready in spans:
                problem = check(ls) if check is not None else None
                if problem is not None:
                    if self.error is None:
                        self.error = problem
                    continue
                ls.ready = tuple(ready)
                ls.state = SpanState.LOADED
                ls.buffer = None
                self._loaded += 1
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Stop handing out pieces; the first error wins."""
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()

    def close(self, final_error: BaseException | None) -> None:
        """The loader has stopped: wake every waiter."""
        with self.cond:
            self.final_error = final_error
            self.closed = True
            self.cond.notify_all()

    # -- program -------------------------------------------------------------------------------
    @property
    def all_loaded(self) -> bool:
        return self._loaded == len(self.spans)

    def wait(self, ls: LoadSpan) -> float:
        """Block until ``ls`` is loaded, moving it to the head of the queue; returns the seconds
        waited (0.0 when it already was). Raises the restore's error if it never will be."""
        if ls.state is SpanState.LOADED:
            return 0.0
        started = time.perf_counter()
        with self.cond:
            if ls.state is not SpanState.LOADED and not ls.urgent and ls.next_chunk < ls.chunks:
                ls.urgent = True
                self._urgent.appendleft(ls)
            while ls.state is not SpanState.LOADED:
                if self.closed:
                    raise self._error_for(ls)
                self.cond.wait()
        return time.perf_counter() - started

    def wait_all(self, timeout: float | None = None) -> float:
        """Block until every span is loaded (raises the error if one never will be)."""
        started = time.perf_counter()
        deadline = None if timeout is None else started + timeout
        with self.cond:
            while not self.all_loaded:
                if self.closed:
                    missing = next(ls for ls in self.spans if ls.state is not SpanState.LOADED)
                    raise self._error_for(missing)
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    raise TimeoutError(f"restore still loading after {timeout} s")
                self.cond.wait(left)
        return time.perf_counter() - started

    def _error_for(self, ls: LoadSpan) -> BaseException:
        if self.final_error is not None:
            return self.final_error
        return CheckpointError(f"storage #{ls.index} was never loaded (the restore stopped)")
