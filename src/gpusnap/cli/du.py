"""``gpusnap du ROOT``: the bytes each checkpoint holds, unique to it or shared with others,
and what the root occupies. Checkpoints are attributed from their manifests alone; the
root's totals come from pack indexes (a checkpoint root) or slab file sizes (a fast tier's
root). No chunk byte is read.

A byte is *unique* to a checkpoint when no other checkpoint names it, *shared* otherwise.
In a checkpoint root a byte is a stored chunk (one per digest, whichever checkpoints name
it); in a fast root it is a slab byte, counted by ranges. So the ``unique`` bytes of every
checkpoint plus the ``shared`` bytes counted once are the bytes the checkpoints reference:
in a checkpoint root, the packs' chunk bytes less the dead ones (packs gc keeps because
some of their chunks are still live).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from gpusnap.cli.extents import manifest_chunks
from gpusnap.errors import IntegrityError
from gpusnap.storage.fast_tier import SLABS, FastTier
from gpusnap.storage.layout import PACKS
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.pack import read_pack_index
from gpusnap.storage.ranks import RankedRepository
from gpusnap.storage.repository import Repository

__all__ = ["CheckpointUsage", "RootUsage", "usage"]


@dataclass(frozen=True)
class CheckpointUsage:
    """``logical``: its tensor bytes (before deduplication); ``unique`` and ``shared``: the
    stored bytes it names, which no other checkpoint names / which others name too."""

    manifest: Manifest
    logical: int
    unique: int
    shared: int


@dataclass(frozen=True)
class RootUsage:
    """What a root's checkpoints reference and what its data files occupy.

    ``files``: packs (a checkpoint root) or slab files (a fast root); ``on_disk``: their
    sizes; ``stored``: the chunk bytes in them (a fast root: every slab byte); ``referenced``
    = sum of ``unique`` + ``shared``; ``dead`` = ``stored`` - what is referenced and found
    (chunks nothing names, copies of one chunk in two packs; a fast root: free slab bytes);
    ``missing``: referenced bytes no pack holds; ``unreadable``: data files whose index cannot
    be read (counted in ``on_disk`` only)."""

    tier: str
    checkpoints: tuple[CheckpointUsage, ...]
    shared: int
    files: int
    on_disk: int
    stored: int
    dead: int
    missing: int
    unreadable: tuple[str, ...]

    @property
    def referenced(self) -> int:
        return sum(c.unique for c in self.checkpoints) + self.shared


def usage(repo: Repository, manifests: list[Manifest]) -> RootUsage:
    # place -> (lo, hi, owner) for each chunk each checkpoint names
    extents: dict[str, list[tuple[int, int, int]]] = {}
    for owner, m in enumerate(manifests):
        for c in manifest_chunks(m):
            extents.setdefault(c.place, []).append((c.lo, c.hi, owner))
    files = _data_files(repo)
    unique, shared, shared_once, found = _attribute(extents, len(manifests), files.held)
    return RootUsage(
        tier="fast" if isinstance(repo, FastTier) else "durable",
        checkpoints=tuple(CheckpointUsage(m, m.nbytes, unique[i], shared[i]) for i, m in enumerate(manifests)),
        shared=shared_once,
        files=files.count,
        on_disk=files.on_disk,
        stored=files.stored,
        dead=files.stored - found,
        missing=sum(unique) + shared_once - found,
        unreadable=files.unreadable,
    )


def _attribute(
    extents: dict[str, list[tuple[int, int, int]]], n: int, held: set[str] | None
) -> tuple[list[int], list[int], int, int]:
    """Per owner, bytes only it covers and bytes others cover too; bytes covered by two or
    more (once); bytes covered in places that are stored (every place when ``held`` is None)."""
    unique, shared = [0] * n, [0] * n
    shared_once = found = 0
    for place, ranges in extents.items():
        events = sorted([(lo, 1, o) for lo, _, o in ranges] + [(hi, -1, o) for _, hi, o in ranges])
        active: Counter[int] = Counter()
        prev = 0
        for pos, delta, owner in events:
            if pos > prev and active:
                length = pos - prev
                if len(active) == 1:
                    unique[next(iter(active))] += length
                else:
                    shared_once += length
                    for o in active:
                        shared[o] += length
                if held is None or place in held:
                    found += length
            active[owner] += delta
            if not active[owner]:
                del active[owner]
            prev = pos
    return unique, shared, shared_once, found


@dataclass(frozen=True)
class _DataFiles:
    count: int
    on_disk: int
    stored: int
    held: set[str] | None  # digests the packs hold; None for a fast root (a range is its own place)
    unreadable: tuple[str, ...]


def _data_files(repo: Repository) -> _DataFiles:
    backend = repo.backend
    if isinstance(repo, FastTier):
        names = [n for n in backend.listdir(SLABS) if n.endswith(".slab")] if backend.isdir(SLABS) else []
        total = sum(backend.size(f"{SLABS}/{n}") for n in names)
        return _DataFiles(len(names), total, total, None, ())
    count = on_disk = stored = 0
    held: set[str] = set()
    unreadable: list[str] = []
    for path in _pack_files(repo):
        try:
            index = read_pack_index(backend, path)
        except FileNotFoundError:
            continue  # a gc removed it meanwhile
        except IntegrityError as exc:
            unreadable.append(str(exc))
            count += 1
            on_disk += backend.size(path)
            continue
        count += 1
        on_disk += index.size
        stored += sum(n for _, _, n in index.entries)
        held.update(d for d, _, _ in index.entries)
    return _DataFiles(count, on_disk, stored, held, tuple(unreadable))


def _pack_files(repo: Repository) -> list[str]:
    if isinstance(repo, RankedRepository):  # every rank's packs too
        return repo._pack_paths()
    backend = repo.backend
    if not backend.isdir(PACKS):
        return []
    fans = [f for f in backend.listdir(PACKS) if len(f) == 2]
    return [f"{PACKS}/{f}/{n}" for f in fans for n in backend.listdir(f"{PACKS}/{f}") if n.endswith(".pack")]
