"""Promotion: one committed fast-tier checkpoint written into a durable root.

The durable copy is an ordinary checkpoint of that root (the same atomic commit, the same id,
tag, tree and stats), its chunks named by the device hashes the fast tier already holds
(``nh:...``, storage/chunk_names.py): the host hashes nothing again. Each run of chunks is
written straight from the slab (O_DIRECT where the root's file system takes it; what it cannot
take from there goes through the pack writer's staging block). Once every run is written, the
slab bytes they were written from are checked against their device hashes on the device, in
a few large passes (one host-to-device copy and one launch per :data:`CHECK_BYTES`; the host's
nh128 without a device): bytes that changed in the slab before or while they were written
(another process's retention, a tier removed and made again, a flipped bit) fail the check,
and the commit comes only after it, so they never reach the durable root. A failure (or
``cancelled()`` turning true) aborts the durable transaction, leaving both roots as they were.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager

from gpusnap.errors import CheckpointError
from gpusnap.storage.chunk_names import device_name
from gpusnap.storage.fast_tier import FastTier, chunk_location
from gpusnap.storage.host_bytes_hash import hash_device
from gpusnap.storage.manifest import Manifest, StorageEntry
from gpusnap.storage.repository import Repository

__all__ = ["CHECK_BYTES", "RUN_BYTES", "CancelToken", "PromotionCancelled", "check_runs", "pool_cpu_s", "promote"]

# Chunks checked together (one host-to-device copy and one hash launch on the GPU): a call
# per 4 MiB chunk cost the training thread the driver's and the interpreter's locks
RUN_BYTES = 64 << 20
# Bytes checked in one pass once every run is written. A check after each run's write (180
# passes for 11.4 GB, spread over the seconds the disk takes) cost a training loop ~0.6 s a
# promotion; the same bytes checked in 256 MiB passes back to back cost it 26-57 ms
# (BENCHMARKS.md, 2026-12-07, fourth). The device scratch is this large, on one thread.
CHECK_BYTES = 256 << 20


class PromotionCancelled(CheckpointError):
    """The promotion was called off (its checkpoint deleted meanwhile): nothing was committed."""


class CancelToken:
    """Calls a promotion off. :meth:`cancel` and the commit exclude each other: once
    ``cancel()`` returns, the promotion either had committed already or never will."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.cancelled = False

    def cancel(self) -> None:
        with self._lock:  # (waits for a commit in progress: then its durable copy exists)
            self.cancelled = True

    def check(self, checkpoint_id: str) -> None:
        if self.cancelled:
            raise PromotionCancelled(f"the promotion of {checkpoint_id} was called off: nothing was committed")

    @contextmanager
    def committing(self, checkpoint_id: str) -> Iterator[None]:
        with self._lock:
            self.check(checkpoint_id)
            yield


def promote(fast: FastTier, manifest: Manifest, durable: Repository, pool: ThreadPoolExecutor | None = None,
            extra_stats: dict[str, object] | None = None, cancel: CancelToken | None = None) -> Manifest:
    """Commit ``manifest``'s checkpoint (from ``fast``) to ``durable``; returns the durable manifest.

    ``pool`` writes runs of chunks (each straight from the slab); a failure raises once no run
    is still being read or written. The slab bytes are then checked on this thread, before
    the commit.
    ``cancel`` called off: :class:`PromotionCancelled` (asked before each run, each check pass and the commit)."""
    started, cpu, cpu_pool = time.perf_counter(), time.thread_time(), pool_cpu_s(pool)
    device = hash_device(e.device for e in manifest.storages)  # (its own GPU: one host copy and one launch a pass)
    cancel = cancel if cancel is not None else CancelToken()

    fast.pin_checkpoint(manifest.id)
    try:
        with durable.begin_write() as txn:
            txn.allow_device_names()
            runs = check_runs([n for e in manifest.storages for n in e.chunks], manifest.chunk_size, RUN_BYTES)

            def store(run: list[str]) -> list[str]:
                cancel.check(manifest.id)
                data = fast.run_view(run, manifest.chunk_size)  # (slab memory: written from where it is)
                names, lengths = [], []
                for name in run:
                    device_hash, _slab, _off, n = chunk_location(name)
                    names.append(device_name(device_hash))
                    lengths.append(n)
                txn.put_run(names, data, lengths)  # (one write for the run: see WriteTxn.put_run)
                return names

            stores = [pool.submit(store, run) for run in runs] if pool is not None else []
            try:
                done = (f.result() for f in stores) if pool is not None else map(store, runs)
                digests = [d for run in done for d in run]
            finally:  # (after a failure: nothing more starts, and nothing still runs once the txn ends)
                for f in stores:
                    f.cancel()
                wait(stores)
            # checked after every write: bytes that were wrong before it, or changed while it
            # ran, fail here; the commit never names a chunk this check has not passed
            for group in check_runs([n for e in manifest.storages for n in e.chunks], manifest.chunk_size,
                                    CHECK_BYTES):
                cancel.check(manifest.id)
                fast.check_bytes(group, fast.run_view(group, manifest.chunk_size), manifest.chunk_size, device)
            entries, at = [], 0
            for e in manifest.storages:
                k = len(e.chunks)
                entries.append(StorageEntry(e.nbytes, e.device, tuple(digests[at : at + k]), e.hashes))
                at += k
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
