"""The pipelined loader: reader threads move chunks from storage into the targets, in place.

Per chunk, on one reader thread::

    take (Schedule) -> read into a host slot -> verify its digest -> copy into the targets
                    -> release the slot (with the copy's CUDA event) -> chunk_done

On CUDA the copy is an async host-to-device copy on a per-device copy stream, so reading the
next chunk overlaps it; the slot is reused only after the copy's event (``SlotPool``). A span
is *loaded* once its last chunk's copy is queued: an event recorded then on the copy stream
covers all of its copies, since a stream runs them in the order they were queued.

Spans whose targets are not byte-for-byte contiguous (transposed, strided, overlapping) are
read whole into a host buffer and applied at once (``RestorePlan.apply_span``), so no tensor
of theirs is ever half-written. Streamed spans are verified chunk by chunk before each chunk
is copied: a corrupt chunk never lands, but chunks before it in the same span may have; the
error then names those tensors (see docs/restore.md, "Guarantees").
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from gpusnap.device import host_buffer, waitable_event
from gpusnap.errors import CheckpointError
from gpusnap.restore.schedule import LoadSpan, Schedule, SpanState
from gpusnap.restore.staging import SlotPool
from gpusnap.state.apply import RestorePlan
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.repository import Repository

__all__ = ["Loader", "describe_span"]


def describe_span(plan: RestorePlan, index: int) -> str:
    """``tensor a, b, c (+N more)`` for error messages."""
    paths = plan.span_paths.get(index, [])
    shown = ", ".join(paths[:3]) + (f" (+{len(paths) - 3} more)" if len(paths) > 3 else "")
    return f"tensor {shown}" if shown else f"storage #{index}"


class Loader:
    """Loads every span of ``manifest`` into ``plan``'s targets on ``threads`` reader threads.

    Call order: ``Loader(...)`` -> ``start()`` (on the thread whose CUDA streams the restore
    must follow) -> ``schedule.wait(span)`` / ``wait()`` from anywhere -> ``on_done(error)`` is
    called once, on a reader thread, after every copy has completed (or the load failed).
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
        on_done: Callable[[BaseException | None], None] | None = None,
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
        spans = [
            LoadSpan(
                index=i,
                nbytes=e.nbytes,
                chunks=len(e.chunks),
                streamed=plan.streamable(i),
                devices=frozenset(plan.devices(i)),
            )
            for i, e in enumerate(manifest.storages)
        ]
        self.schedule = Schedule(spans, order)
        self.threads = max(1, min(threads, sum(ls.chunks for ls in spans) or 1))
        self.bytes_read = 0
        self.chunks_read = 0
        self.started = 0.0
        self.finished: float | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._alive = 0
        self._launched = False
        self._done = threading.Event()

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self.started = time.perf_counter()
        for device, stream in self.streams.items():
            # Copies follow the work the program already queued: a kernel still reading a target
            # must not see the restored bytes early.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            stream.wait_event(event)
        for ls in self.schedule.spans:
            if ls.chunks == 0:
                self.plan.apply_span(ls.index, torch.empty(0, dtype=torch.uint8))
        self._alive = self.threads
        self._launched = True
        for i in range(self.threads):
            threading.Thread(target=self._run, name=f"gpusnap-restore-{i}", daemon=True).start()

    def done(self) -> bool:
        return self._done.is_set()

    def join(self, timeout: float | None = None) -> bool:
        """Until the readers have stopped and every copy has run; True if they have (or never ran)."""
        return not self._launched or self._done.wait(timeout)

    def wait(self, timeout: float | None = None) -> None:
        """Until every span is loaded and its copies have run; raises the load's error."""
        if not self.join(timeout):
            raise TimeoutError(f"restore of {self.manifest.id} still loading after {timeout} s")
        if self.error is not None:
            raise self.error

    # -- reader threads ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while (item := self.schedule.take()) is not None:
                self._load(*item)
        except BaseException as exc:  # noqa: BLE001 (any failure stops the load; waiters must not hang)
            self.schedule.fail(exc)
        finally:
            with self._lock:
                self._alive -= 1
                last = self._alive == 0
            if last:
                self._close()

    def _load(self, ls: LoadSpan, k: int) -> None:
        start = k * self.chunk_size
        n = min(self.chunk_size, ls.nbytes - start)
        digest = self.manifest.storages[ls.index].chunks[k]
        what = describe_span(self.plan, ls.index)
        applied = 0
        if ls.streamed:
            slot = self.slots.acquire()
            events: list[tuple[torch.device, Any]] = []
            try:
                data = slot[:n]
                self.repo.read_chunk_into(digest, memoryview(data.numpy()), what=what, verify=self.verify)
                with self._on_copy_streams(ls):
                    self.plan.apply_range(ls.index, start, data)
                    events = self._record(ls)
                applied = n
            finally:
                self.slots.release(slot, [event for _, event in events])
        else:
            with self._lock:
                if ls.buffer is None:
                    ls.buffer = host_buffer(ls.nbytes, pinned=False)
                buffer = ls.buffer
            self.repo.read_chunk_into(
                digest, memoryview(buffer[start : start + n].numpy()), what=what, verify=self.verify
            )
        with self._lock:
            self.bytes_read += n
            self.chunks_read += 1
        if self.schedule.chunk_done(ls, applied):
            with self._on_copy_streams(ls):
                if not ls.streamed:
                    assert ls.buffer is not None
                    self.plan.apply_span(ls.index, ls.buffer)  # pageable source: copied before it returns
                    ls.applied_bytes = ls.nbytes
                ready = self._record(ls)
            self.schedule.mark_loaded(ls, ready)

    @contextlib.contextmanager
    def _on_copy_streams(self, ls: LoadSpan) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for device in ls.devices:
                if device.type == "cuda":
                    stack.enter_context(torch.cuda.stream(self.streams[device]))
            yield

    def _record(self, ls: LoadSpan) -> list[tuple[torch.device, Any]]:
        """An event after the copies queued so far, on each of the span's copy streams."""
        events = []
        for device in ls.devices:
            if device.type == "cuda":
                event = waitable_event()
                event.record(self.streams[device])
                events.append((device, event))
        return events

    def _close(self) -> None:
        """Last reader out: wait for the copies, then publish the outcome."""
        error = self.schedule.error
        try:
            for stream in self.streams.values():
                stream.synchronize()
            self.slots.drain()
        except BaseException as exc:  # noqa: BLE001 (reported through the handle)
            error = error or exc
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
