"""One save into the fast tier: room reserved at save(), regions carved from it by the
copier, the manifest published at commit (``FastTier.publish``).

States: ``open -> committing -> committed``, or ``-> aborted``. The tier keeps the
transaction's reserved (``extents``) and reused (``held``) ranges busy until it ends.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpusnap.errors import CheckpointError
from gpusnap.storage.backend_protocol import BackendLock
from gpusnap.storage.fast_chunks import FastChunks, chunk_location, chunk_ranges, span_runs
from gpusnap.storage.layout import TMP
from gpusnap.storage.manifest import Manifest, StorageEntry
from gpusnap.storage.slab_layout import ALIGN, Extent

if TYPE_CHECKING:
    from gpusnap.storage.fast_tier import FastTier

__all__ = ["FastTxn"]


class FastTxn:
    """One save into the fast tier: room reserved at save() (:meth:`reserve`), regions carved
    from it by the copier (:meth:`take`), the manifest published by :meth:`commit`."""

    def __init__(self, tier: FastTier, lock: BackendLock) -> None:
        self.tier = tier
        self.token = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._lock: BackendLock | None = lock
        self.state = "open"
        self.extents: list[Extent] = []  # reserved room (FastTier.reserve), under the tier's lock
        self.held: list[tuple[int, int, int]] = []  # (slab, lo, hi) of reused chunks, likewise
        self.reused: set[str] = set()  # names of the reused chunks
        # the slab ranges the manifest to commit names, when its capture worked them out
        # (from where it placed each chunk, in array operations); else parsed from the manifest
        self._placed: dict[int, list[tuple[int, int]]] | None = None
        self.map_s = 0.0  # seconds spent creating and mapping slabs (take)
        self._memory: dict[int, torch.Tensor] = {}  # slab -> its mapped memory, as take() met it
        tier.txn_opened(self)

    def __enter__(self) -> FastTxn:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.state == "open":
            self.abort()

    def reserve(self, nbytes: int, piece: int) -> bool:
        """Room for ``nbytes`` (in copies of at most ``piece`` bytes), or False: the tier is full."""
        return self.tier.reserve(self, nbytes, piece)

    def take(self, n: int) -> tuple[int, int, torch.Tensor] | None:
        """The next ``n`` reserved bytes: ``(slab, offset, host tensor)``, or None when the
        reservation is used up. Maps (and on first use creates) the slab."""
        for e in self.extents:
            start = -(-e.cursor // ALIGN) * ALIGN
            if start + n <= e.hi:
                e.cursor = start + n
                memory = self._memory.get(e.slab)
                if memory is None:  # (once per slab and save: a piece is taken per copy)
                    started = time.perf_counter()
                    memory = self._memory[e.slab] = self.tier.slab_memory(e.slab)
                    self.map_s += time.perf_counter() - started
                return e.slab, start, memory[start : start + n]
        return None

    def give_back(self, slab: int, offset: int, n: int) -> None:
        """Return the last region taken from its extent (a failed copy); others wait for the end."""
        for e in self.extents:
            if e.slab == slab and e.cursor == offset + n:
                e.cursor = offset
                return

    def reuse(self, chunks: dict[int, str]) -> dict[int, str]:
        """Of ``chunks`` (index -> fast name), those still stored, held until commit or abort."""
        if self.state != "open":
            raise CheckpointError(f"write transaction is {self.state}")
        return self.tier.keep_reused(self, chunks)

    def locate(self, name: str) -> tuple[int, int]:
        """``(slab, offset)`` of the stored chunk ``name``."""
        _h, slab, offset, _n = chunk_location(name)
        return slab, offset

    def entries(self, slabs: np.ndarray, offsets: np.ndarray, first: Sequence[int], counts: Sequence[int],
                sizes: np.ndarray, chunk_size: int, spans: Sequence[tuple[int, str]],
                hashes: Sequence[tuple[str, ...]]) -> tuple[StorageEntry, ...]:
        """The storage table of this save (see ``storage.sink.SlabSink.entries``): each span's
        chunks as runs of slab bytes named by their device hashes, found for the whole save
        at once; the slab ranges they name are kept for :meth:`commit` (no parse there)."""
        runs = span_runs(slabs, offsets, first, counts, chunk_size)
        self._placed = chunk_ranges(slabs, offsets, sizes)
        return tuple(StorageEntry(n, device, FastChunks(h, r, nbytes=n, chunk_size=chunk_size), h)
                     for (n, device), r, h in zip(spans, runs, hashes))

    def commit(self, manifest: Manifest) -> None:
        """Publish ``manifest`` (its chunks' bytes are in the slabs already); its ranges become used."""
        if self.state != "open":
            raise CheckpointError(f"write transaction is {self.state}")
        self.state = "committing"
        try:
            self.tier.publish(self.token, manifest, self._placed)
        except BaseException:
            self.abort()
            raise
        self.state = "committed"
        self._release()

    def abort(self) -> None:
        """Give the reserved room back and drop temporary files. Idempotent."""
        if self.state in ("aborted", "committed"):
            return
        self.state = "aborted"
        try:
            for name in self.tier.backend.listdir(TMP):
                if name.startswith(f"{self.token}-"):
                    self.tier.backend.remove(f"{TMP}/{name}")
        except OSError:
            pass
        self._release()

    def _release(self) -> None:
        registered = self.tier.txn_closed(self)
        self.extents, self.held = [], []
        self._memory = {}
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()
        if registered:
            self.tier.drop_lease_hold()
