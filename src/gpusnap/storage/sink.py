"""Where capture hands storage its result: the two sinks a save writes into.

Call order (``capture.concurrent``, ``capture.stop_the_world``): the saving code opens a
sink (``Repository.begin_write``), capture stores each chunk (:class:`ChunkSink`: hashed on
the host, written into packs) or copies it straight into reserved slab memory
(:class:`SlabSink`: named by its device hash and place), reuses chunks unchanged since the
previous checkpoint (``reuse``), and returns the manifest's storage table; the caller then
commits the manifest, or aborts. Capture imports only these protocols and the public types
of ``gpusnap.storage``, never a transaction's class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from gpusnap.storage.manifest import Manifest, StorageEntry
from gpusnap.storage.slab_layout import room_needed

__all__ = ["ChunkSink", "SlabMemory", "SlabSink", "fast_room_needed"]

fast_room_needed = room_needed  # slab bytes one save into the fast tier may take


class ChunkSink(Protocol):
    """A durable root's write transaction (``storage.txn.WriteTxn``): chunks by digest."""

    def has_chunk(self, digest: str) -> bool:
        """Whether ``digest`` is stored already (then pinned: name it without storing it)."""
        ...

    def put_chunk(self, digest: str, data: bytes | bytearray | memoryview) -> bool:
        """Store one chunk unless known; False when deduplicated. Thread-safe."""
        ...

    def reuse(self, chunks: dict[int, str]) -> dict[int, str]:
        """Of ``chunks`` (index -> digest), those still stored, pinned until commit or abort."""
        ...

    def allow_device_names(self) -> None:
        """The program's own state may be stored by device hash (``nh:`` names) from now on."""
        ...

    def commit(self, manifest: Manifest) -> None: ...

    def abort(self) -> None: ...


class SlabMemory(Protocol):
    """What a save into the fast tier learns of the tier's memory (``FastTier``)."""

    pinned: bool  # slabs are page-locked (CUDA present) ...
    register_errors: list[str]  # ... unless a slab's page-locking was refused

    def prepared_bytes(self) -> int:
        """Slab bytes this process has mapped."""
        ...


class SlabSink(Protocol):
    """A fast tier's write transaction (``storage.fast_txn.FastTxn``): reserved slab bytes
    the copier writes into, chunks named by device hash and place."""

    tier: SlabMemory
    map_s: float  # seconds spent creating and mapping slabs

    def take(self, n: int) -> tuple[int, int, torch.Tensor] | None:
        """The next ``n`` reserved bytes ``(slab, offset, host tensor)``; None: used up."""
        ...

    def give_back(self, slab: int, offset: int, n: int) -> None:
        """Return the last region taken (a failed copy)."""
        ...

    def reuse(self, chunks: dict[int, str]) -> dict[int, str]:
        """Of ``chunks`` (index -> fast name), those still stored, held until commit or abort."""
        ...

    def locate(self, name: str) -> tuple[int, int]:
        """``(slab, offset)`` of the stored chunk ``name`` (one :meth:`reuse` returned)."""
        ...

    def entries(self, slabs: np.ndarray, offsets: np.ndarray, first: Sequence[int], counts: Sequence[int],
                sizes: np.ndarray, chunk_size: int, spans: Sequence[tuple[int, str]],
                hashes: Sequence[tuple[str, ...]]) -> tuple[StorageEntry, ...]:
        """The storage table of a save whose chunk ``g`` lies at ``offsets[g]`` of slab
        ``slabs[g]`` (``sizes[g]`` bytes), span ``i`` being chunks ``first[i] ..
        first[i] + counts[i] - 1`` of ``spans[i]`` = ``(bytes, device)``, named by
        ``hashes[i]``; the sink keeps where they lie for its commit."""
        ...

    def commit(self, manifest: Manifest) -> None: ...

    def abort(self) -> None: ...
