"""One concurrent save: the window, the tracker on the saving thread, the copier, the writers.

Call order: ``start()`` on the thread that called ``save()`` (records the consistent point,
pushes the tracker, starts the copier) -> the program runs on -> ``finish()`` on any thread
(waits for every chunk to be stored; returns the storage table) -> the saving thread pops the
tracker at its next gpusnap call (``reap``).

The copier hands over finished pieces in batches of about one piece's bytes (only the copier
thread waits on CUDA events: a dozen threads blocked in the driver slowed the program's
launches); one writer task per batch then hashes and stores the chunks and releases the
staging regions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from itertools import chain
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import torch

from gpusnap import launch_hooks
from gpusnap.capture import resize_guard
from gpusnap.capture.copier import Copier, Piece
from gpusnap.capture.options import CaptureOptions
from gpusnap.capture.staging import StagingArena
from gpusnap.capture.trace import Trace
from gpusnap.capture.tracker import TrackerMode
from gpusnap.capture.validation import HashTable, unchanged_chunks
from gpusnap.capture.warmup import wait_loaded
from gpusnap.capture.window import CaptureWindow, SnapshotBuffer, WindowSpan
from gpusnap.errors import CheckpointError, ValidationError
from gpusnap.kernels.hashing import chunk_digest
from gpusnap.state.flatten import FlatState
from gpusnap.storage import CHECK_SLICE_BYTES, ChunkSink, SlabSink, StorageEntry, device_name, hash_host_bytes

__all__ = ["ConcurrentSave"]

_NOTHING: frozenset[int] = frozenset()


class ConcurrentSave:
    def __init__(
        self,
        flat: FlatState,
        open_txn: Callable[[], ChunkSink | SlabSink],
        options: CaptureOptions,
        *,
        staging: StagingArena,
        io_pool: ThreadPoolExecutor,
        streams: dict[torch.device, Any],
        trace: Trace | None = None,
        copier_runner: Executor | None = None,
    ) -> None:
        self.options = opt = options
        chunk_size, piece_bytes, validate, previous, fast = (
            opt.chunk_size, opt.piece_bytes, opt.validate, opt.previous, opt.fast)
        self.flat = flat
        # fast: ``staging`` is the fast tier's slab memory (capture/fast_arena.py); a chunk's
        # name is its device hash and location, so every chunk is hashed on its device and
        # nothing is hashed or written on the host
        self.fast = fast
        self._open_txn = open_txn
        self._txn: Any = None  # a ChunkSink, or (fast) a SlabSink
        self._txn_refused: BaseException | None = None  # set once the save is over (abort_txn)
        self._txn_lock = threading.Lock()
        self.staging = staging
        self.io_pool = io_pool
        self.chunk_size = chunk_size
        t0 = time.perf_counter()
        # where the constructor's host time goes (save()'s stall: stats["save_phases_s"])
        self.phases: dict[str, float] = {}
        self.window = CaptureWindow(
            flat, order=opt.order, cow_budget=opt.cow_budget, eager_cpu_bytes=opt.eager_cpu_bytes,
            trace=trace, log_reads=opt.log_reads, eager=opt.eager, eager_device_bytes=opt.eager_device_bytes,
            snapshot_budget=opt.snapshot_budget, snapshot_cpu_bytes=opt.snapshot_cpu_bytes,
        )
        # Snapshots were copied at save() in the program's stream order: no write can reach
        # them, so they need neither validation hashes nor a tracker. The tracker still runs
        # when a span is live, or when this window must log the program's reads.
        t1 = time.perf_counter()
        self.phases["window"] = t1 - t0  # of which the snapshot copy:
        self.phases["snapshot"] = self.window.snapshot_s
        # (not for a trace alone). A fast save copied whole at save() logs no reads: the
        # tracker would slow every op of its window to learn an order a lazy restore can do
        # without (it then loads in the checkpoint's own order, the model's for most models)
        self.tracked = not self.window.all_snapshotted or (opt.log_reads and not fast)
        validate = (validate or fast) and not self.window.all_snapshotted  # fast: names are hashes
        # Stored digests of every span's chunks, in one list: span i's chunk k is
        # digests[first[i] + k] (one list per span made ~1745 more objects per save for
        # Python's collector, which live until the commit)
        counts = -(-np.fromiter((s.end - s.start for s in flat.spans), dtype=np.int64, count=len(flat.spans))
                   // chunk_size)
        self._first: list[int] = (np.cumsum(counts) - counts).tolist()
        self._counts: list[int] = counts.tolist()
        self.digests: list[str | None] = [None] * int(counts.sum())
        # fast: where each chunk lies instead (slab -1: not placed yet), made into runs of
        # slab bytes at finish() with a few array operations (storage/fast_chunks.py)
        if fast:
            self._slabs = np.full(len(self.digests), -1, dtype=np.int64)
            self._offsets = np.zeros(len(self.digests), dtype=np.int64)
            self._placed: list[tuple[int, int, int, int]] = []  # (first chunk, chunks, slab, offset) a segment
        self.bytes_written = 0
        self.bytes_skipped = 0
        self._sizes: np.ndarray | None = None  # see _chunk_sizes
        self._futures: list[Future[None]] = []
        self._lock = threading.Lock()
        # The consistent point's hashes, enqueued in the program's stream order (validation.py)
        incremental = previous is not None  # even with nothing stored yet: the hashes go
        self.previous: Mapping[str, str] = previous if previous is not None else {}  # into the manifest
        self.before: HashTable | None = None
        self.after: HashTable | None = None
        self.skipped: dict[int, Collection[int]] = {}  # span index -> chunks not copied (incremental)
        # compared with ``previous`` before copying: the copier waits for the consistent-point
        # hashes first. Off (skip_unchanged=False) when comparing is not expected to pay: the
        # hashes still go into the manifest, and every chunk is copied at once.
        self.compared = bool(previous) and opt.skip_unchanged
        self.bytes_unchanged = 0  # found unchanged by the comparison (not by the store's dedup)
        self.mismatched: list[str] = []
        hashing = validate or incremental or fast
        if hashing:
            # Spans not snapshotted are hashed now, in the program's stream order; snapshots
            # cannot change, so the copier hashes them later, off the caller's time. With
            # nothing to hash now, the copier sets the table up too (1.5-2.5 ms of save() on
            # GPT-2 large's 1745 spans).
            now = [i for i, s in enumerate(flat.spans) if s.nbytes and i not in self.window.snapshotted]
            if now:  # (the hash kernels, if they still load: this save waits for them here)
                self.phases["kernels"] = wait_loaded({flat.spans[i].device for i in now})
                self.before = HashTable(flat.spans, chunk_size)
                self.before.fill_many(now, [flat.spans[i].as_bytes() for i in now])
        if validate:
            self.after = HashTable(flat.spans, chunk_size)
        t2 = time.perf_counter()
        self.phases["hash_tables"] = t2 - t1
        self._before_hex: list[tuple[str, ...]] | None = None
        self._kept: list[SnapshotBuffer] | None = None  # see _keep_snapshots
        self.window.on_close(self._drop_kept)  # a failed save never hashes what it kept
        events = {}
        for device in streams:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))  # the consistent point, in stream order
            events[device] = event
        self.copier = Copier(
            self.window,
            staging,
            self._sink,
            chunk_size=chunk_size,
            piece_bytes=piece_bytes,
            ahead=opt.ahead,
            consistent_events=events,
            streams=streams,
            # compared: the hashes first, the copies skip what is unchanged; otherwise the
            # hashes once the window has closed (see _hash_snapshots)
            prepare=(self._hash_snapshots if self.compared else self._keep_snapshots) if hashing else None,
            skip=self._skip if self.compared else None,
            after_copy=self._after_copy if validate else None,
            on_drained=self._hashes_to_host if validate else None,
            after_close=self._hash_kept if hashing and not self.compared else None,
            runner=copier_runner,
        )
        self.tracker = TrackerMode(self.window)
        self.owner = threading.get_ident()
        self.phases["copier_init"] = time.perf_counter() - t2

    def start(self) -> None:
        window = self.window
        try:
            if not window.all_snapshotted:  # live spans: a resize must not free them unseen
                window.on_close(lambda: resize_guard.unwatch(window))  # (first: never left watching)
                resize_guard.watch(window)
            if self.tracked:
                # torch wraps every mode's handler in _disable_dynamo, which imports
                # torch._dynamo on its first call (~0.4 s): pay that here, inside save()'s
                # measured stall, not in the program's first op, which would otherwise block
                # until the window had closed.
                import torch._dynamo  # noqa: F401  (imported for its side effect, see above)

                self.tracker.__enter__()
                launch_hooks.add_listener(window.before_opaque_launch)
            self.copier.start()
        except BaseException as exc:  # (Ctrl-C included) no copier will close this window: undo it
            window.close(exc)
            launch_hooks.remove_listener(window.before_opaque_launch)
            if self.tracked:
                self.reap()
            raise

    @property
    def txn(self) -> Any:
        """The write transaction, opened by the first thread that stores (or commits).

        Not at save(): opening takes the root's shared lock, which waits while a retention
        gc holds it exclusively (~200 ms, unlinking an old checkpoint
        from tmpfs), and refreshes the view of stored packs. Opened later, the view also
        includes every chunk the previous save committed meanwhile.
        """
        with self._txn_lock:
            if self._txn is None:
                if self._txn_refused is not None:
                    # the save is over: a store task still queued must not open a transaction
                    # nobody would commit or abort (its lease, lock and pins would leak)
                    raise self._txn_refused
                self._txn = self._open_txn()
                if self.compared and not self.fast and self.copier.streams:  # (CUDA spans: see _device_named)
                    self._txn.allow_device_names()
            return self._txn

    def abort_txn(self, error: BaseException | None = None) -> None:
        """Abort the transaction if one was opened, and refuse to open one from now on."""
        with self._txn_lock:
            if self._txn_refused is None:
                self._txn_refused = error if error is not None else CheckpointError("this save was abandoned")
            if self._txn is not None:
                self._txn.abort()

    def close_out(self, error: BaseException) -> None:
        """A failed save, on the thread that owns it: close the window, wait until the copier
        and every store task have stopped (their own errors are ``error``'s consequences), then
        abort the transaction. Nothing of the save keeps running, or holding the root, after."""
        try:
            self.window.close(error)
            self.copier.join()
            launch_hooks.remove_listener(self.window.before_opaque_launch)
            with self._lock:
                futures = list(self._futures)
            wait(futures)
            self._kept = None
        finally:  # (an interrupt meanwhile: the transaction still goes, and no new one opens)
            self.abort_txn(error)

    def _drop_kept(self) -> None:
        if self.window.error is not None:
            self._kept = None

    def _hash_kept(self) -> None:
        """Copier thread, once the window has closed: hash the kept snapshots on the copy
        streams, then let them go. The writers store meanwhile, so the hash is off the path to
        the commit (enqueueing it took 170-230 ms of a thread's time on GPT-2 large training,
        waiting for the GIL), and the snapshots' device memory goes back
        seconds before the commit instead of at it."""
        if self._kept is not None:
            self._hash_snapshots()

    def _keep_snapshots(self) -> None:
        """Copier thread, before any copy: hold the snapshot buffers, whose spans the copier
        lets go of one by one, until :meth:`_hash_kept` has hashed them."""
        self._kept = self.window.snapshot_buffers()

    def _hash_snapshots(self) -> None:
        """On the copy streams (which waited for the consistent point, so after the
        snapshots): the consistent-point hashes of snapshotted spans, then every
        consistent-point hash to the host.

        A save that compares with the previous checkpoint runs this on the copier thread
        before its first copy: it needs the hashes to know what to copy. One that does not
        only needs them in its manifest: the copier runs it once the window has closed
        (:meth:`_hash_kept`).
        On the copier thread it kept the window open 175-350 ms longer on GPT-2 large training
        (BENCHMARKS.md): not GPU time (a probe found every call it makes
        returns in under 1 ms with the GPU busy), but a thread waiting for the GIL, which the
        program's step holds. The snapshot buffers stay allocated until then.

        Each device's snapshots are hashed from their one buffer, with no tensor per span."""
        if self.before is None:  # (see __init__: nothing was hashed at save())
            self.before = HashTable(self.flat.spans, self.chunk_size)
        kept, self._kept = self._kept, None
        marks = self.copier.marks
        snaps = kept if kept is not None else self.window.snapshot_buffers()
        if wait_loaded({snap.buffer.device for snap in snaps}):  # (loading since set-up)
            marks["kernels_loaded"] = time.perf_counter()
        marks["hashing"] = time.perf_counter()
        for snap in snaps:
            self.before.fill_packed([ws.index for ws in snap.spans], snap.buffer, snap.offsets)
        del kept
        marks["hashes_enqueued"] = time.perf_counter()
        self.before.to_host_async()
        marks["hashes_to_host"] = time.perf_counter()

    def before_hex(self) -> list[list[str]]:
        if self._before_hex is None:
            assert self.before is not None
            self._before_hex = self.before.hex()
        return self._before_hex

    def _skip(self, ws: WindowSpan) -> Collection[int]:
        """Copier thread: chunks of ``ws`` unchanged since the previous checkpoint (their
        stored digests are reused)."""
        span = ws.span
        same = unchanged_chunks(self.before_hex()[ws.index], self.previous)
        if same:  # pinned by the transaction until it commits (a retention meanwhile keeps
            same = self.txn.reuse(same)  # their packs); those already deleted are copied
        for k, digest in same.items():
            if self.fast:
                slab, offset = self.txn.locate(digest)
                self._slabs[self._first[ws.index] + k] = slab
                self._offsets[self._first[ws.index] + k] = offset
            else:
                self.digests[self._first[ws.index] + k] = digest
            size = min(self.chunk_size, span.nbytes - k * self.chunk_size)
            with self._lock:
                self.bytes_skipped += size
                self.bytes_unchanged += size
        if same:
            # every chunk unchanged (frozen weights: the common case) is a range, which the
            # garbage collector does not track; a save keeps one per span for seconds
            chunks = self._counts[ws.index]
            self.skipped[ws.index] = range(chunks) if len(same) == chunks else set(same)
        return self.skipped.get(ws.index, _NOTHING)

    def _after_copy(self, ws: WindowSpan, start: int, src: torch.Tensor) -> None:
        assert self.after is not None
        if ws.index not in self.window.snapshotted:  # a snapshot cannot have changed
            self.after.fill(ws.index, src, start // self.chunk_size)

    def _hashes_to_host(self) -> None:
        assert self.after is not None
        self.after.to_host_async()  # the copier's current streams: after every copy and hash

    def _validate(self) -> str:
        """Compare the hashes after each copy with the consistent point's; raise on mismatch."""
        if self.after is None:
            if self.window.all_snapshotted:
                return "ok: every span was copied at save(), in stream order (nothing to validate)"
            return "off: unseen writes are not detected (docs/capture.md)"
        before, after = self.before_hex(), self.after.hex()
        checked = 0
        for i, span in enumerate(self.flat.spans):
            if i in self.window.snapshotted:
                continue
            skipped = self.skipped.get(i, ())
            bad = [k for k in range(len(before[i])) if k not in skipped and before[i][k] != after[i][k]]
            checked += len(before[i]) - len(skipped)
            if bad:
                self.mismatched.append(span.paths[0] if span.paths else f"storage #{i}")
        if self.mismatched:
            shown = ", ".join(self.mismatched[:5]) + (f" (+{len(self.mismatched) - 5} more)" if len(self.mismatched) > 5 else "")
            raise ValidationError(
                f"a write the tracker did not see changed {shown} while the checkpoint was being "
                "taken (a custom kernel, a numpy/cupy view, an unhooked graph or Triton launch); "
                "nothing was committed, and these tensors are captured at save() from now on"
            )
        return f"ok: {checked} chunks hashed before and after their copy"

    def _sink(self, pieces: list[Piece]) -> None:
        if self.fast:
            self._locate_many(pieces)
            return
        # one task per batch of finished pieces (not per chunk, not per piece): fewer Python
        # task switches competing with the program for the GIL; the bytes are on the host
        future = self.io_pool.submit(self._store_many, pieces)
        with self._lock:
            self._futures.append(future)

    def _store_many(self, pieces: list[Piece]) -> None:
        for k, (segments, region) in enumerate(pieces):
            started = time.perf_counter()
            try:
                for ws, start, n, offset in segments:
                    self._store(ws.index, start, region.data[offset : offset + n])
            except BaseException as exc:
                for _segments, later in pieces[k + 1 :]:
                    self.staging.release(later)
                self.window.close(exc)  # stop the copier, release the program
                raise
            finally:
                self.staging.release(region)
                if self.window.trace is not None:
                    name = f"piece {segments[0][0].index}:{segments[0][1]}" + (f" +{len(segments) - 1}" if len(segments) > 1 else "")
                    self.window.trace.span("store", name, started, time.perf_counter())

    def _locate_many(self, pieces: list[Piece]) -> None:
        """Fast tier, on the copier thread: the pieces' bytes are where they will stay, so
        storing is recording where each segment's chunks lie (named in :meth:`finish`)."""
        cs = self.chunk_size
        for segments, region in pieces:
            for ws, start, n, offset in segments:
                if (self.after is not None and ws.span.device.type == "cpu"
                        and ws.index not in self.window.snapshotted):
                    self.after.fill(ws.index, region.data[offset : offset + n], start // cs)  # the stored bytes
                # (one tuple a segment: the arrays are filled at finish(), in one go)
                self._placed.append((self._first[ws.index] + start // cs, -(-n // cs), region.slab, region.start + offset))
                with self._lock:
                    self.bytes_written += n

    def _fast_entries(self, hashes: list[tuple[str, ...]]) -> tuple[StorageEntry, ...]:
        """Fast tier: each span's chunks as runs of slab bytes, named by their device hashes
        (storage/fast_chunks.py), found for the whole save at once."""
        cs = self.chunk_size
        if self._placed:  # each copied segment's chunks lie back to back from its offset
            base, count, slab, offset = np.array(self._placed, dtype=np.int64).T
            within = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
            where = np.repeat(base, count) + within
            self._slabs[where] = np.repeat(slab, count)
            self._offsets[where] = np.repeat(offset, count) + within * cs
            self._placed = []
        unplaced = int(np.count_nonzero(self._slabs < 0))
        if unplaced:  # (every chunk was copied or reused: a bug, never committed)
            raise CheckpointError(f"{unplaced} chunk(s) of this save were never placed in the fast tier; "
                                  "nothing was committed")
        devices: dict[torch.device, str] = {}  # (str() of a torch.device is slow; a save has a few)
        spans = [(s.nbytes, devices.get(s.device) or devices.setdefault(s.device, str(s.device))) for s in self.flat.spans]
        # the sink names the chunks, and keeps the slab ranges they name for its commit
        return self.txn.entries(self._slabs, self._offsets, self._first, self._counts, self._chunk_sizes(), cs,
                                spans, hashes)

    def _store(self, index: int, start: int, data: torch.Tensor) -> None:
        """Hash and store the chunks of span ``index`` that start at byte ``start`` (``data``
        holds whole chunks, the span's last one possibly short)."""
        if (
            self.after is not None
            and self.flat.spans[index].device.type == "cpu"
            and index not in self.window.snapshotted
        ):
            self.after.fill(index, data, start // self.chunk_size)  # the staged bytes
        view_all = memoryview(data.numpy()).cast("B")
        named = self._device_named(index)
        first_chunk = start // self.chunk_size
        if named is not None:
            self._check_staged(index, view_all, named[first_chunk : first_chunk + -(-len(view_all) // self.chunk_size)])
        for off in range(0, data.numel(), self.chunk_size):
            view = view_all[off : off + self.chunk_size]
            digest = chunk_digest(view) if named is None else device_name(named[first_chunk + off // self.chunk_size])
            txn = self.txn
            wrote = not txn.has_chunk(digest) and txn.put_chunk(digest, view)
            with self._lock:
                if wrote:
                    self.bytes_written += len(view)
                else:
                    self.bytes_skipped += len(view)
            self.digests[self._first[index] + (start + off) // self.chunk_size] = digest

    def _device_named(self, index: int) -> Sequence[str] | None:
        """Span ``index``'s consistent-point hashes, when its chunks are stored under them
        (``nh:`` names, storage/chunk_names.py: the host hashes nothing), else None (BLAKE2b).

        For a CUDA span copied at save() (a snapshot: no write can reach its bytes) whose hashes
        are on the host before any copy (a compared save: the copier waited for them), so the
        names describe the stored bytes, which :meth:`_check_staged` checks before storing. A
        live span keeps BLAKE2b: an unseen write there is validation's to catch, and to retry,
        after the copies. A CPU span keeps BLAKE2b too: its hash costs the host as much either
        way, and a blocking save of host state (stop-the-world, BLAKE2b) would otherwise store
        its unchanged chunks again under the other name."""
        span = self.flat.spans[index]
        if not self.compared or span.device.type != "cuda" or index not in self.window.snapshotted:
            return None
        return self.before_hex()[index]

    def _check_staged(self, index: int, staged: memoryview, names: Sequence[str]) -> None:
        """The staged bytes of span ``index`` (a snapshot's) hash to the names they are stored
        under, on the span's GPU (one copy back and one launch per slice), before any is
        stored: a chunk named by a device hash must hold those bytes, or every later chunk of
        that hash would be deduplicated against wrong ones. A mismatch (the copy itself went
        wrong: nothing writes a snapshot) fails the save; nothing is committed."""
        got = hash_host_bytes(staged, self.chunk_size, self.flat.spans[index].device, slice_bytes=CHECK_SLICE_BYTES)
        bad = [k for k, (g, want) in enumerate(zip(got, names)) if g != want]
        if bad or len(got) != len(names):
            span = self.flat.spans[index]
            raise CheckpointError(
                f"the bytes copied from {span.paths[0] if span.paths else f'storage #{index}'} differ from the "
                f"device's at the save's consistent point ({len(bad)} chunk(s)); nothing was committed")

    def wait_captured(self, timeout: float | None = None) -> None:
        self.copier.join(timeout)

    def finish(self) -> tuple[StorageEntry, ...]:
        """Wait until every chunk is stored; raise the first failure."""
        self.copier.join()
        self.window.settle()
        if self.copier.after_close_error is not None and self.window.error is None:
            self.window.error = self.copier.after_close_error
        launch_hooks.remove_listener(self.window.before_opaque_launch)
        with self._lock:
            futures = list(self._futures)
        wait(futures)
        try:
            for f in futures:
                f.result()
            if self.window.error is not None:
                raise self.window.error
        except BaseException:
            self._kept = None  # a failed save hashes nothing: its snapshots go back
            raise
        self.validation = self._validate()
        hashes = self.before_hex() if self.before is not None else [None] * len(self.flat.spans)
        if self.previous and not self.compared:
            self.bytes_unchanged = self._unchanged_bytes(hashes)
        if self.fast:  # (every span is hashed: its chunks are named by their hashes)
            return self._fast_entries(hashes)  # type: ignore[arg-type]
        return tuple(
            StorageEntry(
                nbytes=s.nbytes,
                device=str(s.device),
                chunks=tuple(d for d in self.digests[first : first + count] if d is not None),
                hashes=None if h is None or not self._describes_stored(i) else tuple(h),
            )
            for i, (s, first, count, h) in enumerate(zip(self.flat.spans, self._first, self._counts, hashes))
        )

    def _describes_stored(self, index: int) -> bool:
        """Whether span ``index``'s consistent-point hashes are known to be those of the bytes
        stored for it: it was copied at save() (a snapshot), its copies were validated, or
        every chunk was skipped as stored already. Otherwise (``validate=False``, copied from
        live memory) an unseen write may have changed the stored bytes: the manifest records
        no device hash for it, so no later incremental save trusts the pair (it copies the
        span again) and a restore checks it on the host, by its digests."""
        return (
            self.after is not None
            or index in self.window.snapshotted
            or len(self.skipped.get(index, ())) == self._counts[index]
        )

    def _unchanged_bytes(self, hashes: list[list[str]]) -> int:
        """Bytes whose chunk hash the previous checkpoint holds: what comparing would have
        skipped. A save that copied at once learns it after the fact, for a few dict lookups,
        so the next save can decide whether comparing pays (``CaptureHistory.should_compare``)."""
        known = self.previous.keys()
        # (C loops and array operations: no Python per chunk, nor per span)
        found = np.fromiter(map(known.__contains__, chain.from_iterable(hashes)), dtype=bool, count=len(self.digests))
        return int(self._chunk_sizes()[found].sum())

    def _chunk_sizes(self) -> np.ndarray:
        """Each chunk's bytes (``chunk_size``, but each span's last may be short), made once."""
        if self._sizes is None:
            cs = self.chunk_size
            counts = np.asarray(self._counts, dtype=np.int64)
            nbytes = (np.asarray(self.before.spans_nbytes, dtype=np.int64) if self.before is not None else
                      np.fromiter((s.end - s.start for s in self.flat.spans), dtype=np.int64, count=len(counts)))
            sizes = np.full(int(counts.sum()), cs, dtype=np.int64)
            some = counts > 0
            sizes[(np.asarray(self._first, dtype=np.int64) + counts - 1)[some]] = nbytes[some] - (counts[some] - 1) * cs
            self._sizes = sizes
        return self._sizes

    def reap(self) -> bool:
        """Pop the tracker if the window is closed and this is its thread (top of stack only)."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        if not self.tracked or threading.get_ident() != self.owner or not self.window.closed:
            return False
        if _get_current_dispatch_mode() is self.tracker:
            self.tracker.__exit__(None, None, None)
            return True
        return False
