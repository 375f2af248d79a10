"""Where a restore's batches come from: a :class:`Source` fills an owned :class:`Region`.

Three sources, one interface (the loader picks one by configuration; ``Loader``):

    HostReads    (host_reads.py)    reader threads read the packs into a host region
    ProcReads    (proc_reads.py)    a reader process per thread reads them into a shared
                                     host region; the host path for what it cannot do
    DirectReads  (direct_reads.py)  a helper process per thread copies them from the page
                                     cache into a landing slot on the device; the host path
                                     (processes or threads) for what it cannot do

Ownership, the one rule every path follows: a region has exactly one owner at a time, from
``fill`` (the reader thread) to the copy thread (``Copier.put``) to the pool again through
:meth:`Region.release`, which is idempotent: whoever holds the region when anything fails
calls it, and a second call (a cleanup that runs after a normal release) does nothing. So
a reader waiting for a free region is woken on every path: success, integrity error,
cancellation, a worker's death.

A worker process that dies or stops answering surfaces in bounded time as
``reader_procs.ReaderDied`` (end of its pipe, or ``REPLY_TIMEOUT_S``); its source then has the
host path fill the batch, counted in the stats (``proc_fallbacks``, ``direct_fallbacks``),
and never asks that worker again in this load.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from gpusnap.restore.pipeline.schedule import Piece
from gpusnap.restore.pipeline.staging import SlotPool

__all__ = ["Batch", "Region", "Source"]

Batch = list[tuple[Piece, int]]  # (piece, offset in the region): Schedule.take_batch
_RELEASE = threading.Lock()  # (one release at a time: the owner's and a late cleanup's may race)


class Region:
    """A batch's bytes in one region of ``pool`` (``data``, each piece at its offset), owned by
    whoever holds this object until :meth:`release`.

    ``on_device``: ``data`` is a landing slot on the batch's device (direct copies), whose
    bytes are there once the helper's CUDA event ``after`` has completed (None: already).
    Otherwise ``data`` is host memory, page-locked when ``pinned``.

    What the source still has to do for piece ``j`` (read it, check its digests on the host)
    runs in :meth:`settle` on the reader thread, before the piece is written anywhere: the
    copy thread only ever gets settled regions, so it does no I/O and no hashing.
    """

    __slots__ = ("pieces", "data", "on_device", "after", "pinned", "host_verify", "reads", "_settle", "_pool")

    def __init__(self, pieces: Batch, data: torch.Tensor, pool: SlotPool, *, on_device: bool = False,
                 after: Any = None, host_verify: bool = False,
                 settle: Callable[[Region, int], None] | None = None) -> None:
        self.pieces = pieces
        self.data = data
        self.on_device = on_device
        self.after = after
        self.pinned = pool.pinned and not on_device
        self.host_verify = host_verify  # the source checks the pieces' digests on the host
        self.reads: Any = None  # the source's notes on how it read the pieces (for settle)
        self._settle = settle  # None: every piece is settled
        self._pool: SlotPool | None = pool

    def settle(self, j: int) -> None:
        """Piece ``j``'s bytes are in ``data`` at its offset, checked as far as the source checks
        on the host; raises (``IntegrityError``, a storage error) otherwise. The region stays
        owned by the caller either way."""
        if self._settle is not None:
            self._settle(self, j)

    def settle_with(self, settle: Callable[[Region, int], None] | None, reads: Any = None) -> None:
        """What :meth:`settle` does from now on (None: nothing), with the source's ``reads``."""
        self._settle, self.reads = settle, reads

    def settle_all(self) -> None:
        if self._settle is not None:
            for j in range(len(self.pieces)):
                self._settle(self, j)

    @property
    def released(self) -> bool:
        return self._pool is None

    def release(self) -> None:
        """Give the region back to the pool it came from, once: nothing queued reads it any
        more. Later calls do nothing."""
        with _RELEASE:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.release(self.data)


class Source(Protocol):
    """What the loader's reader threads take batches' bytes from.

    Call order, per batch on reader thread ``k``: ``region = source.fill(batch, k,
    host_verify=...)`` -> ``region.settle(j)`` for each piece (before it is written) -> the
    region goes to the copy thread, or is written by the reader (host targets) and released.
    ``fill`` blocks only for a free region (which the copy thread gives back) and for a
    worker's answer (bounded: a worker that does not answer is killed).
    """

    def fill(self, batch: Batch, k: int, *, host_verify: bool) -> Region:
        """A region the caller owns, holding (or, after ``settle``, to hold) ``batch``'s bytes;
        ``host_verify``: check their digests on the host. Raises with no region held."""
        ...
