"""Staging that *is* the fast tier: the copier's regions are reserved bytes of slab files.

With a fast root, a copy piece goes from the device (or a CPU span) straight into the slab
memory the checkpoint will live in (page-locked once per process), so nothing copies it
again on the host and nothing writes it through a system call. It offers the copier the
methods of :class:`~gpusnap.capture.staging.StagingArena` it uses; a region handed to the
sink stays the save's (its location goes into the manifest), and only a piece that failed
comes back.
"""

from __future__ import annotations

from gpusnap.capture.staging import Region
from gpusnap.errors import CheckpointError
from gpusnap.storage import SlabSink, fast_room_needed

__all__ = ["FastArena", "room_needed"]


room_needed = fast_room_needed  # slab bytes one save may take (storage.slab_layout.room_needed)


class FastArena:
    """The copier's arena for one save into the fast tier (``txn`` holds the reservation)."""

    def __init__(self, txn: SlabSink, piece: int) -> None:
        self.txn = txn
        self.piece = piece
        self.bytes_taken = 0

    @property
    def pinned(self) -> bool:
        """Whether the regions are page-locked: every slab is, unless the tier met a refusal
        (its slabs then pageable, ``FastTier.register_errors``), or CUDA is absent."""
        tier = self.txn.tier
        return bool(tier.pinned) and not tier.register_errors

    def max_region(self) -> int:
        return self.piece

    def can_grow(self) -> bool:
        return False

    def try_allocate(self, n: int, *, wait: bool = False) -> Region | None:
        return self.allocate(n)

    def allocate(self, n: int) -> Region:
        got = self.txn.take(n)
        if got is None:  # the reservation covers every piece: a bug, never a wait
            raise CheckpointError(f"the fast tier's reservation for this save ran out ({n} more bytes)")
        slab, offset, data = got
        self.bytes_taken += n
        return Region(slab, offset, offset + n, data)  # type: ignore[arg-type]  (slab: its number)

    def release(self, region: Region) -> None:
        """A piece that failed: its bytes go back (they are not in any manifest)."""
        if not region.released:
            region.released = True
            self.txn.give_back(region.slab, region.start, region.end - region.start)  # type: ignore[arg-type]

    def reserve(self, nbytes: int) -> float:
        return 0.0

    @property
    def nbytes(self) -> int:
        """Slab bytes this process has mapped (the fast tier's staging)."""
        return self.txn.tier.prepared_bytes()

    @property
    def grow_s(self) -> float:
        """Seconds this save spent creating and page-locking slabs."""
        return self.txn.map_s
