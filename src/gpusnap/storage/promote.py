"""Promotion: one committed fast-tier checkpoint written into a durable root.

The durable copy is an ordinary checkpoint of that root (the same atomic commit, the same id,
tag, tree and stats), its chunks named by the device hashes the fast tier already holds
(``nh:...``, storage/chunk_names.py): the host hashes nothing again. Each run of chunks is
written straight from the slab (O_DIRECT where the root's file system takes it; what it cannot
take from there goes through the pack writer's staging block). As soon as the runs of a
group of up to :data:`CHECK_BYTES` are written, the promoter's thread checks the group's slab
bytes against their device hashes on the device (the host's nh128 without a device), in
order: bytes that changed in the slab before or while they were written (another process's
retention, a tier removed and made again, a flipped bit) fail the check, unless the change
was undone before it, and the commit comes only after every check, so they never reach the
durable root. Small chunks (a model's norms and biases, an optimizer's step counters, short
tails: ~250 of the ~400 groups of a 0.95B Llama's training state) are gathered instead: copied
out of the slabs into the promotion's own memory, checked there on the host in one pass, and
written from that copy as one run, so the bytes written are the bytes checked, at the cost of
one check and one write instead of one each. A failure (or ``cancelled()`` turning true)
aborts the durable transaction, leaving both roots as they were.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from gpusnap.errors import CheckpointError
from gpusnap.storage.chunk_names import device_name
from gpusnap.storage.fast_tier import FastTier, chunk_location
from gpusnap.storage.host_bytes_hash import hash_device
from gpusnap.storage.manifest import Manifest, StorageEntry
from gpusnap.storage.repository import Repository
from gpusnap.storage.run_writers import RunWriters

__all__ = ["CHECK_BYTES", "GATHER_BYTES", "RUN_BYTES", "SMALL_BYTES", "CancelToken", "PromotionCancelled", "check_runs",
           "gather_small", "pool_cpu_s", "promote"]

# Chunks checked together (one host-to-device copy and one hash launch on the GPU): a call
# per 4 MiB chunk cost the training thread the driver's and the interpreter's locks
RUN_BYTES = 64 << 20
# Bytes checked together, on the promoter's thread, once their runs are written. A check
# after each 64 MiB run on the pool's threads (180 checks for 11.4 GB from 8 threads, spread
# over the seconds the disk takes) cost a training loop ~0.6 s a promotion; the same bytes
# checked from one thread in 256 MiB groups back to back cost it 26-44 ms (BENCHMARKS.md,
# 2026-12-07, fourth). Here the groups are checked as their writes end, 4x fewer checks than
# runs, from one thread: a promoted save then cost the loop 254.5-560.1 ms in medians, down
# from ~1 s (fifth).
CHECK_BYTES = 256 << 20
# A chunk at most this long is gathered (see the module docstring): each check of one in a
# device pass of its own cost the promoter's thread ~0.8 ms of CPU, most of it holding the
# interpreter lock the training thread then waits for (BENCHMARKS.md, seventh section). At
# most GATHER_BYTES of them a promotion, in order (the host hashes ~1 GB/s a core; the rest
# go the device's way).
SMALL_BYTES = 64 << 10
GATHER_BYTES = 32 << 20


class PromotionCancelled(CheckpointError):
    """The promotion was called off (its checkpoint deleted meanwhile): nothing was committed."""


class CancelToken:
    """Calls a promotion off. :meth:`cancel` and the commit exclude each other: once
    ``cancel()`` returns, the promotion either had committed already or never will."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.cancelled = False
        self._listeners: list[Callable[[], None]] = []

    def cancel(self) -> None:
        with self._lock:  # (waits for a commit in progress: then its durable copy exists)
            self.cancelled = True
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def when_cancelled(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener`` once cancelled (at once if it is already; a promotion process
        is told so); returns what unregisters it."""
        with self._lock:
            now = self.cancelled
            if not now:
                self._listeners.append(listener)
        if now:
            listener()
        return lambda: self._forget(listener)

    def _forget(self, listener: Callable[[], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def check(self, checkpoint_id: str) -> None:
        if self.cancelled:
            raise PromotionCancelled(f"the promotion of {checkpoint_id} was called off: nothing was committed")

    @contextmanager
    def committing(self, checkpoint_id: str) -> Iterator[None]:
        with self._lock:
            self.check(checkpoint_id)
            yield


def promote(fast: FastTier, manifest: Manifest, durable: Repository, pool: ThreadPoolExecutor | None = None,
            extra_stats: dict[str, object] | None = None, cancel: CancelToken | None = None,
            workers: int = 1) -> Manifest:
    """Commit ``manifest``'s checkpoint (from ``fast``) to ``durable``; returns the durable manifest.

    ``pool`` writes runs of chunks (each straight from the slab), in order, from ``workers``
    tasks of its own (``storage/run_writers.py``; at most as many as the pool has threads); this thread checks
    each group's slab bytes once its runs are written. A failure raises once no run is still
    being read or written.
    ``cancel`` called off: :class:`PromotionCancelled` (asked before each run, each check pass and the commit)."""
    started, cpu, cpu_pool = time.perf_counter(), time.thread_time(), pool_cpu_s(pool)
    device = hash_device(e.device for e in manifest.storages)  # (its own GPU: one host copy and one launch per slice)
    cancel = cancel if cancel is not None else CancelToken()

    fast.pin_checkpoint(manifest.id)
    try:
        with durable.begin_write() as txn:
            txn.allow_device_names()
            every = [n for e in manifest.storages for n in e.chunks]
            gathered, rest = gather_small(every, manifest.chunk_size)
            groups = [(group, check_runs(group, manifest.chunk_size, RUN_BYTES))
                      for group in check_runs(rest, manifest.chunk_size, CHECK_BYTES)]
            written: dict[str, str] = {}  # fast-tier name -> durable name

            def record(names: list[str], durable_names: list[str]) -> None:
                if len(names) != len(durable_names):  # (a bug of ours: the manifest would misname chunks)
                    raise CheckpointError(f"a promotion of {manifest.id} wrote {len(durable_names)} chunks "
                                          f"for {len(names)}")
                written.update(zip(names, durable_names))

            def put(run: list[str], data: bytes | bytearray | memoryview) -> list[str]:
                names, lengths = [], []
                for name in run:  # (each name parsed once: this runs on the writers' threads)
                    device_hash, _slab, _off, n = chunk_location(name)
                    names.append(device_name(device_hash))
                    lengths.append(n)
                txn.put_run(names, data, lengths)  # (one write for the run: see WriteTxn.put_run)
                return names

            def store(run: list[str]) -> list[str]:
                cancel.check(manifest.id)
                return put(run, fast.run_view(run, manifest.chunk_size))  # (slab memory: written from where it is)

            def store_gathered() -> None:
                cancel.check(manifest.id)
                record(gathered, put(gathered, fast.copy_checked(gathered)))  # (checked in our copy, written from it)

            def check(group: list[str]) -> None:
                cancel.check(manifest.id)
                # (the same slab map the runs were written from: the tier keeps its maps open
                # while the checkpoint is pinned)
                fast.check_bytes(group, fast.run_view(group, manifest.chunk_size), manifest.chunk_size, device)

            writers = RunWriters([(k, run) for k, (_group, runs) in enumerate(groups) for run in runs], store)
            try:
                if pool is not None:  # (inside: tasks started before a refused one are stopped too)
                    writers.start(pool, workers)
                if gathered:  # (on this thread, while the pool writes the first runs)
                    store_gathered()
                for k, (group, runs) in enumerate(groups):
                    record(group, writers.group(k) if pool is not None else [d for run in runs for d in store(run)])
                    # checked once its writes are done: bytes that were wrong before them, or
                    # changed while they ran, fail here unless undone meanwhile (a window of
                    # one group's writes, not the promotion's); the commit names no chunk unchecked
                    check(group)
            finally:  # (after a failure: nothing more starts, and nothing still runs once the txn ends)
                writers.stop()
            unwritten = [n for n in every if n not in written]
            if unwritten:  # (a bug of ours: the manifest would name chunks never stored)
                raise CheckpointError(f"a promotion of {manifest.id} left {len(unwritten)} chunks unwritten")
            entries = [StorageEntry(e.nbytes, e.device, tuple(written[n] for n in e.chunks), e.hashes)
                       for e in manifest.storages]
            stats = dict(manifest.stats)
            stats["promotion_s"] = time.perf_counter() - started
            # this thread's and the pool's CPU until now (the commit's own fsyncs are not in it)
            stats["promotion_cpu_s"] = time.thread_time() - cpu + pool_cpu_s(pool) - cpu_pool
            stats.update(extra_stats or {})
            promoted = Manifest(id=manifest.id, tag=manifest.tag, created=manifest.created,
                                chunk_size=manifest.chunk_size, storages=tuple(entries), tree=manifest.tree,
                                stats=stats)
            with cancel.committing(manifest.id):
                txn.commit(promoted)
            return promoted
    finally:
        fast.unpin_checkpoint(manifest.id)


def gather_small(names: list[str], chunk_size: int) -> tuple[list[str], list[str]]:
    """``(gathered, rest)``: the chunks of ``names`` shorter than ``chunk_size`` (each a run
    of its own) and at most :data:`SMALL_BYTES` long, up to :data:`GATHER_BYTES` in all, and
    the others; each list in the order of ``names``."""
    gathered: list[str] = []
    rest: list[str] = []
    room = GATHER_BYTES
    for name in names:
        n = chunk_location(name)[3]
        if 0 < n < chunk_size and n <= min(SMALL_BYTES, room):
            gathered.append(name)
            room -= n
        else:
            rest.append(name)
    return gathered, rest


def check_runs(names: list[str], chunk_size: int, run_bytes: int = RUN_BYTES) -> list[list[str]]:
    """``names`` (in order) cut into runs that :meth:`FastTier.check_run` checks in one pass:
    whole ``chunk_size`` chunks back to back in one slab, at most ``run_bytes`` a run; any
    other chunk (a span's shorter tail) is a run of its own."""
    runs: list[list[str]] = []
    end: tuple[int, int] | None = None  # where the current run would continue
    for name in names:
        _h, slab, offset, length = chunk_location(name)
        if length == chunk_size and end == (slab, offset) and (len(runs[-1]) + 1) * chunk_size <= run_bytes:
            runs[-1].append(name)
        else:
            runs.append([name])
        end = (slab, offset + length) if length == chunk_size else None
    return runs


def pool_cpu_s(pool: ThreadPoolExecutor | None) -> float:
    """CPU seconds of ``pool``'s threads so far (Linux: /proc thread stats), else 0."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for t in list(getattr(pool, "_threads", ())) if pool is not None else []:
        tid = getattr(t, "native_id", None)
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return total
