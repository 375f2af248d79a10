"""A fast tier's space: which slab bytes retained manifests use, how much the tier may hold,
and reserving room for a save.

:class:`SlabSpace` is a part of :class:`~gpusnap.storage.fast_tier.FastTier` (a base class
it builds on, one idea per file). Nothing but committed manifests records which slab bytes
are used: the map is rebuilt from them (a scan), and each commit adds its ranges.
"""

from __future__ import annotations

import builtins
import os
import threading
from typing import TYPE_CHECKING

from gpusnap.config import Config
from gpusnap.errors import CheckpointError, StorageError
from gpusnap.storage.backend_protocol import Backend
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.slab_layout import ALIGN, SLAB_ROUND, Extent, add_ranges, merge_ranges

if TYPE_CHECKING:
    from gpusnap.storage.fast_txn import FastTxn

__all__ = ["SlabSpace"]


class SlabSpace:
    """Used and free slab bytes, the tier's bound, reservations (under the tier's ``_alloc``)."""

    backend: Backend
    config: Config
    root: str
    _mutex: threading.RLock
    _alloc: threading.Condition
    _slab_sizes: dict[int, int]
    _used: dict[int, builtins.list[tuple[int, int]]] | None
    _used_generation: int
    _ranges: dict[str, tuple[Manifest, dict[int, builtins.list[tuple[int, int]]]]]
    _fast_txns: set[FastTxn]
    _pinned_ids: dict[str, int]
    _capacity: int | None
    _budget: int | None

    def _used_map(self) -> dict[int, builtins.list[tuple[int, int]]]:
        """Slab ranges named by retained manifests (merged, sorted), from a fresh scan once.

        A scan that a commit (or a forget) overtook is done again: the commit, finding no map
        to add its ranges to, relies on the rebuild's listing, which may predate its manifest."""
        while True:
            with self._mutex:
                if self._used is not None:
                    return self._used
                generation = self._used_generation
            merged = self._scan_used()
            with self._mutex:
                if self._used_generation == generation:
                    self._used = merged
                    return merged

    def _scan_used(self) -> dict[int, builtins.list[tuple[int, int]]]:
        manifests, bad = self._scan()
        if bad:
            raise CheckpointError(
                f"the fast tier {self.root} has {len(bad)} unreadable manifest(s) ({bad[0].path}: {bad[0].reason}): "
                "which slab bytes they use is unknown, so nothing is written there; delete them"
            )
        used: dict[int, builtins.list[tuple[int, int]]] = {}
        for m in manifests:
            for slab, ranges in self._ranges_of(m).items():
                used.setdefault(slab, []).extend(ranges)
        return {s: merge_ranges(r) for s, r in used.items()}

    def _ranges_of(self, manifest: Manifest,
                   placed: dict[int, builtins.list[tuple[int, int]]] | None = None) -> dict[int, builtins.list[tuple[int, int]]]:
        """The slab ranges ``manifest``'s chunks lie in (merged: a save's regions are mostly
        contiguous, so these are few), parsed once per manifest object; ``placed``: those
        ranges, as the save that wrote the manifest worked them out."""
        with self._mutex:
            known = self._ranges.get(manifest.id)
        if known is not None and known[0] is manifest:
            return known[1]
        if placed is not None:
            merged = placed
        else:
            ranges: dict[int, builtins.list[tuple[int, int]]] = {}
            add_ranges(ranges, manifest)
            merged = {s: merge_ranges(r) for s, r in ranges.items()}
        with self._mutex:
            self._ranges[manifest.id] = (manifest, merged)
        return merged

    def _forget_used(self) -> None:
        with self._alloc:
            self._used = None
            self._used_generation += 1
            self._alloc.notify_all()

    def capacity(self) -> int:
        """Slab bytes this tier may hold: ``Config.fast_tier_bytes``, else what its writer's
        checkpoints need (:meth:`set_budget`; never less than the slabs already there), else,
        for a tier used without a budget, 90% of its file system's free space."""
        with self._mutex:
            if self.config.fast_tier_bytes:
                return self.config.fast_tier_bytes
            if self._budget is not None:
                return self._budget
            if self._capacity is None:
                st = os.statvfs(self.backend.local_path(""))  # type: ignore[attr-defined]
                self._capacity = sum(self.slab_files().values()) + int(st.f_bavail * st.f_frsize * 0.9)
            return self._capacity

    def per_save(self, need: int, piece: int) -> int:
        """Slab bytes one save of ``need`` bytes in pieces of at most ``piece`` may take: a
        piece never straddles a slab's end, so each slab a save spans may leave a piece unused."""
        return need + -(-need // (self.config.fast_slab_bytes - piece)) * piece

    def set_budget(self, saves: int, need: int, piece: int) -> int:
        """Bound the tier to ``saves`` checkpoints of ``need`` bytes (whole 2 MiB slab steps);
        returns the bound. A StorageError naming the size needed when its file system cannot
        hold that beside the slabs already there (checked when the bound grows)."""
        budget = saves * -(-self.per_save(need, piece) // SLAB_ROUND) * SLAB_ROUND
        if self.config.fast_tier_bytes:
            return self.config.fast_tier_bytes
        with self._mutex:
            if self._budget is not None and budget <= self._budget:
                return self._budget
            have = sum(self.slab_files().values())
        more = budget - have
        if more > 0:
            try:
                st = os.statvfs(self.backend.local_path(""))  # type: ignore[attr-defined]
                free = st.f_bavail * st.f_frsize
            except (OSError, AttributeError):
                free = more
            if free < more:
                raise StorageError(
                    f"the fast tier {self.root} needs {budget} bytes of slabs for {saves} checkpoints of {need} bytes "
                    f"(fast_keep_last + 2: those kept, the one being written and one in promotion); it holds {have} "
                    f"and its file system has {free} bytes free: free space there (a container's /dev/shm: "
                    "--shm-size), lower fast_keep_last, or pick another fast_root; nothing was saved"
                )
        with self._mutex:  # (slabs an earlier, larger state left are reused, not removed)
            self._budget = max(budget, have, self._budget or 0)
            return self._budget


    def _busy_ranges(self) -> dict[int, builtins.list[tuple[int, int]]]:
        busy = {s: list(r) for s, r in self._used_map().items()}
        for txn in self._fast_txns:
            for e in txn.extents:
                busy.setdefault(e.slab, []).append((e.lo, e.hi))
            for slab, lo, hi in txn.held:
                busy.setdefault(slab, []).append((lo, hi))
        return {s: merge_ranges(r) for s, r in busy.items()}

    def reserve(self, txn: FastTxn, nbytes: int, piece: int) -> bool:
        """Reserve room for ``txn``: ``nbytes`` in pieces of at most ``piece`` bytes, all or
        nothing (its ``extents``; False: the tier is full)."""
        with self._alloc:
            if self._slab_sizes == {}:
                self._slab_sizes = self.slab_files()
            busy = self._busy_ranges()
            free: builtins.list[tuple[int, int, int]] = []
            for slab, size in sorted(self._slab_sizes.items()):
                at = 0
                for lo, hi in [*busy.get(slab, []), (size, size)]:
                    start = -(-at // ALIGN) * ALIGN
                    if lo - start >= min(piece, ALIGN):
                        free.append((slab, start, lo))
                    at = max(at, hi)
            taken: builtins.list[Extent] = []
            room = 0
            for slab, lo, hi in sorted(free, key=lambda f: f[1] - f[2]):  # largest first
                if room >= nbytes:
                    break
                taken.append(Extent(slab, lo, hi, lo))
                room += max(0, hi - lo - piece)  # a piece that does not fit wastes the tail
            slab_bytes = self.config.fast_slab_bytes
            total = sum(self._slab_sizes.values())
            sizes: dict[int, int] = {}
            while room < nbytes:
                # whole slabs, and a last one no larger than the rest needs (a small state
                # must not cost a GiB of memory and its page-locking)
                size = min(slab_bytes, -(-(nbytes - room + piece) // SLAB_ROUND) * SLAB_ROUND)
                if total + size > self.capacity():
                    return False
                slab = max([*self._slab_sizes, *sizes, -1]) + 1
                sizes[slab] = size
                total += size
                taken.append(Extent(slab, 0, size, 0))
                room += size - piece
            self._slab_sizes.update(sizes)  # the files are made by the copier (FastTxn.take)
            txn.extents = taken
            return True

    def _wait_for_room(self, timeout: float | None) -> bool:
        """Wait until a transaction or promotion here ends (room may have come back)."""
        with self._alloc:
            if not self._fast_txns and not self._pinned_ids:
                return False
            return self._alloc.wait(timeout)

    def wait_for_change(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for a save here to commit or abort, or a retention or a
        promotion to end (room may have come back meanwhile)."""
        with self._alloc:
            self._alloc.wait(timeout)

    def _add_committed(self, manifest: Manifest, placed: dict[int, builtins.list[tuple[int, int]]] | None) -> None:
        """``manifest`` was just published: cached, and its ranges used from now on."""
        ranges = self._ranges_of(manifest, placed)  # (outside the lock: parsing takes a while)
        with self._alloc:
            self.remember_committed(manifest)
            self._used_generation += 1  # (a rebuild listing from before the rename scans again)
            if self._used is not None:
                used = dict(self._used)
                for slab, more in ranges.items():
                    used[slab] = merge_ranges(used.get(slab, []) + more)
                self._used = used
