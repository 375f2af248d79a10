"""Reader threads as a source: each reads its batches' chunks from the packs into host regions.

The host path every other source falls back to, and what plans and counts their reads: the
runs a worker process reads (:meth:`HostReads.plan_runs`), the checks of what it read
(:meth:`HostReads.check_read`), the stats of every piece (:meth:`HostReads.count`).
A piece is read, one system call per run stored back to back, and checked against its
digests (when asked) in :meth:`Region.settle`, on the reader thread, just before it is
written: a corrupt chunk never lands, and the pieces before it in a batch may have.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpusnap.device import only_gpu
from gpusnap.restore.pipeline.schedule import Piece
from gpusnap.restore.pipeline.sources.source import Batch, Region
from gpusnap.restore.pipeline.staging import SlotPool
from gpusnap.restore.pipeline.stats import LoadStats
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.repository import Repository

__all__ = ["HostReads", "PieceRead", "Run"]

Run = tuple[str, int, int, int]  # (local path, file offset, length, offset in the pool's memory)


@dataclass
class PieceRead:
    """A piece a worker process read, with what checking it needs."""

    piece: Piece
    offset: int  # in the region
    digests: tuple[str, ...]
    runs: list[tuple[str, int, int, int]]  # Repository.chunk_runs
    what: str


class HostReads:
    """Reader threads reading into ``pool``'s host regions (see the module docstring)."""

    def __init__(self, repo: Repository, manifest: Manifest, pool: SlotPool, stats: LoadStats,
                 describe: Callable[[int], str], *, verify: bool) -> None:
        self.repo = repo
        self.manifest = manifest
        self.pool = pool
        self.stats = stats
        self.verify = verify
        self.chunk_size = manifest.chunk_size
        self._describe = describe
        self._what: dict[int, str] = {}  # span index -> describe (made once: every read names it)
        self._local: dict[str, str | None] = {}  # pack path -> local path for worker processes

    # -- the source ----------------------------------------------------------------------------
    def fill(self, batch: Batch, k: int, *, host_verify: bool) -> Region:
        """A free region for ``batch``; its pieces are read (and checked) by ``settle``."""
        return Region(batch, self.acquire(), self.pool, host_verify=host_verify, settle=self._read_piece)

    def acquire(self) -> torch.Tensor:
        """A free region of the pool (blocks until the copy thread gives one back); timed."""
        started = time.perf_counter()
        region = self.pool.acquire()
        self.stats.add(region_wait_s=time.perf_counter() - started)
        return region

    def _read_piece(self, region: Region, j: int) -> None:
        piece, offset = region.pieces[j]
        view = self.pool.bytes_of(region.data)
        self.read_into(piece, view[offset : offset + piece.nbytes], host_verify=region.host_verify)

    # -- reads ---------------------------------------------------------------------------------
    def read_into(self, piece: Piece, out: memoryview, *, host_verify: bool) -> None:
        """Read ``piece``'s chunks into ``out`` on this thread, checked when ``host_verify``."""
        digests = self.manifest.storages[piece.span.index].chunks[piece.first : piece.first + piece.count]
        cost = self.repo.read_chunks_into(digests, out, self.chunk_size, what=self.describe(piece.span.index),
                                          verify=host_verify, check_on=only_gpu(piece.span.devices))
        self.count(piece, reads=cost.reads, read_s=cost.read_s, verify_s=cost.verify_s, host_verify=host_verify)

    def plan_runs(self, batch: Batch, base: int) -> tuple[dict[int, PieceRead], list[Run]] | None:
        """Each piece's read (by ``id(piece)``) and the runs ``(local path, pack offset, length,
        base + offset in the batch)`` a worker process reads for the batch; None when a pack
        has no local path (the thread reads it)."""
        reads: dict[int, PieceRead] = {}
        requests: list[Run] = []
        for p, offset in batch:
            what = self.describe(p.span.index)
            digests = self.manifest.storages[p.span.index].chunks[p.first : p.first + p.count]
            runs = self.repo.chunk_runs(digests, self.chunk_size, p.nbytes, what=what)
            for path, pack_offset, first, n in runs:
                local = self._local.get(path, "")
                if local == "":
                    local = self._local[path] = self.repo.local_path(path)
                if local is None:
                    return None
                lo, hi = first * self.chunk_size, min(p.nbytes, (first + n) * self.chunk_size)
                requests.append((local, pack_offset, hi - lo, base + offset + lo))
            reads[id(p)] = PieceRead(p, offset, digests, runs, what)
        return reads, requests

    def check_read(self, read: PieceRead, view: memoryview, *, host_verify: bool) -> None:
        """A piece a worker process read: its chunks' digests checked on the host if asked; counted."""
        p = read.piece
        started = time.perf_counter()
        if host_verify:
            self.repo.check_runs(read.digests, view[read.offset : read.offset + p.nbytes], self.chunk_size,
                                 read.runs, what=read.what, check_on=only_gpu(p.span.devices))
        self.count(p, reads=len(read.runs), read_s=0.0, verify_s=time.perf_counter() - started,
                   host_verify=host_verify)

    def count(self, piece: Piece, *, reads: int, read_s: float, verify_s: float, host_verify: bool) -> None:
        verified = piece.nbytes if self.verify else 0
        self.stats.add(
            bytes_read=piece.nbytes,
            chunks_read=piece.count,
            pieces=1,
            reads=reads,
            read_s=read_s,
            verify_s=verify_s,
            host_verified_bytes=verified if host_verify else 0,
            device_verified_bytes=0 if host_verify else verified,
        )

    def describe(self, index: int) -> str:
        """``describe(index)`` of span ``index``, made once."""
        what = self._what.get(index)
        if what is None:
            what = self._what[index] = self._describe(index)
        return what

