"""Promotion: one committed fast-tier checkpoint copied into a durable root.

The durable copy is an ordinary checkpoint of that root (packs named by BLAKE2b, the same
atomic commit, the same id, tag, tree and stats), so everything that reads a durable root
reads it. The fast checkpoint stays pinned while it is read; each run of its chunks is
copied once out of the slab, and that copy is what is checked against the device hashes,
digested and written: bytes that change in the slab meanwhile (another process's retention,
a tier removed and made again) fail the check instead of reaching the durable root. A
failure (or ``cancelled()`` turning true) aborts the durable transaction, leaving both roots
as they were.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager

import torch

from gpusnap.errors import CheckpointError
from gpusnap.kernels.hashing import chunk_digest
from gpusnap.storage.host_bytes_hash import hash_device
from gpusnap.storage.fast_tier import FastTier, chunk_location
from gpusnap.storage.manifest import Manifest, StorageEntry
from gpusnap.storage.repository import Repository

__all__ = ["RUN_BYTES", "CancelToken", "PromotionCancelled", "check_runs", "pool_cpu_s", "promote"]

# Chunks checked together (one host-to-device copy and one hash launch on the GPU): a call
# per 4 MiB chunk cost the training thread the driver's and the interpreter's locks
RUN_BYTES = 64 << 20


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

    ``pool`` copies, checks, digests and writes runs of chunks (each run read once, its device
    hashes checked first); a failure raises once no run is still being read or written.
    ``cancel`` called off: :class:`PromotionCancelled` (asked before each run and at the commit)."""
    started, cpu, cpu_pool = time.perf_counter(), time.thread_time(), pool_cpu_s(pool)
    device = hash_device(e.device for e in manifest.storages)  # (its own GPU: one host copy and one launch a run)
    scratch = threading.local()  # each thread's copy of the run it stores, reused
    cancel = cancel if cancel is not None else CancelToken()

    fast.pin_checkpoint(manifest.id)
    try:
        with durable.begin_write() as txn:
            runs = check_runs([n for e in manifest.storages for n in e.chunks], manifest.chunk_size, RUN_BYTES)

            def store(run: list[str]) -> list[str]:
                cancel.check(manifest.id)
                run_bytes = sum(chunk_location(n)[3] for n in run)
                buffer = getattr(scratch, "buffer", None)
                if buffer is None or buffer.numel() < run_bytes:
                    buffer = scratch.buffer = torch.empty(max(run_bytes, min(RUN_BYTES, 1 << 20)), dtype=torch.uint8)
                data = fast.copy_run(run, manifest.chunk_size, buffer)
                # device hashes first: corrupt fast bytes must not become a clean durable checkpoint
                fast.check_bytes(run, data, manifest.chunk_size, device)
                digests, at = [], 0
                for name in run:
                    n = chunk_location(name)[3]
                    view = data[at : at + n]
                    at += n
                    digest = chunk_digest(view)  # (hashlib lets the GIL go for large buffers)
                    if not txn.has_chunk(digest):
                        txn.put_chunk(digest, view)
                    digests.append(digest)
                return digests

            stores = [pool.submit(store, run) for run in runs] if pool is not None else []
            try:
                done = (f.result() for f in stores) if pool is not None else map(store, runs)
                digests = [d for run in done for d in run]
            finally:  # (after a failure: nothing more starts, and nothing still runs once the txn ends)
                for f in stores:
                    f.cancel()
                wait(stores)
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
