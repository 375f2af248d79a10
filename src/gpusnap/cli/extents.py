"""Where a checkpoint's bytes lie and what they hold, from its manifest alone: no chunk byte
and no pack is read, so ``diff`` and ``du`` cost one manifest parse per checkpoint.

Every chunk a manifest names has a *content* (what its bytes are: the BLAKE2b digest of a
checkpoint root's chunk, the device hash in a fast chunk's name ``<hash>@<slab>:<off>:<len>``)
and a *place* (where its bytes are stored: a root's chunk is stored once per digest, so the
digest is its place; a fast chunk's place is its slab range). ``diff`` compares contents,
``du`` counts places.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from gpusnap.storage.chunk_names import device_hash_of, is_device_name
from gpusnap.storage.fast_tier import chunk_location
from gpusnap.storage.manifest import Manifest, StorageEntry

__all__ = ["Chunk", "device_hashed", "manifest_chunks", "storage_chunks", "tensor_chunks", "tensor_extent"]


@dataclass(frozen=True)
class Chunk:
    """One chunk of a storage: bytes ``[start, start + nbytes)`` of that storage, stored at
    bytes ``[lo, lo + nbytes)`` of ``place``."""

    content: str
    place: str
    lo: int
    start: int
    nbytes: int

    @property
    def hi(self) -> int:
        return self.lo + self.nbytes


def storage_chunks(entry: StorageEntry, chunk_size: int) -> list[Chunk]:
    """The chunks of ``entry`` in order; a root's chunks are ``chunk_size`` bytes, the last
    one shorter, and a fast chunk's length is in its name."""
    out: list[Chunk] = []
    start = 0
    for name in entry.chunks:
        if _is_fast(name):  # (IntegrityError if the name is malformed)
            content, slab, lo, n = chunk_location(name)
            out.append(Chunk(content, f"slab {slab}", lo, start, n))
        else:  # (a promoted chunk's content is its device hash: equal to the fast chunk it came from)
            n = max(0, min(chunk_size, entry.nbytes - start))
            out.append(Chunk(device_hash_of(name) if is_device_name(name) else name, name, 0, start, n))
        start += out[-1].nbytes
    return out


def device_hashed(m: Manifest) -> bool:
    """Whether ``m``'s chunk contents are device hashes (a fast tier's, or a promotion's
    ``nh:`` names), not BLAKE2b digests."""
    return any(_is_fast(name) or is_device_name(name) for entry in m.storages for name in entry.chunks)


def _is_fast(name: str) -> bool:
    return "@" in name  # <hash>@<slab>:<offset>:<length>


def manifest_chunks(m: Manifest) -> Iterator[Chunk]:
    """Every chunk ``m`` names, storage by storage."""
    for entry in m.storages:
        yield from storage_chunks(entry, m.chunk_size)


def tensor_extent(node: dict[str, Any], itemsize: int | None, storage_nbytes: int) -> tuple[int, int]:
    """Bytes ``[lo, hi)`` of its storage that a tensor node's elements cover (its whole
    storage when its dtype is unknown here)."""
    shape = [int(d) for d in node.get("shape", ())]
    if itemsize is None:
        return 0, storage_nbytes
    if any(d == 0 for d in shape):
        return 0, 0
    stride = [int(s) for s in node.get("stride", ())]
    last = sum((d - 1) * s for d, s in zip(shape, stride))
    lo = int(node.get("byte_offset", 0))
    return lo, lo + (last + 1) * itemsize


def tensor_chunks(chunks: Iterable[Chunk], lo: int, hi: int) -> tuple[Chunk, ...]:
    """The chunks of a storage that hold any of its bytes ``[lo, hi)``."""
    return tuple(c for c in chunks if c.start < hi and c.start + c.nbytes > lo)
