"""Verify of a fast tier: every chunk of the selected manifests read back from its slab and
checked against its device hash (``storage.verify`` does a durable root's packs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gpusnap.errors import CheckpointError, IntegrityError
from gpusnap.storage.fast_chunks import chunk_location
from gpusnap.storage.slab_layout import slab_path
from gpusnap.storage.verify import VerifyReport, deleted_meanwhile, select_manifests

if TYPE_CHECKING:
    from gpusnap.storage.fast_tier import FastTier
    from gpusnap.storage.manifest import Manifest

__all__ = ["verify_fast"]


def verify_fast(
    tier: FastTier, checkpoint_id: str | None, progress: Callable[[int], None] | None,
    on_total: Callable[[int], None] | None = None,
) -> VerifyReport:
    """:func:`verify` of a fast tier: every chunk of the selected manifests read from its
    slab (``FastTier.read_chunk``, which checks its 128-bit device hash); a chunk whose slab
    is gone or too short is missing. Slab bytes no manifest names are free space, not
    problems (a crashed save's, or a deleted checkpoint's).

    No lock: the writer's retention must not wait for a reader (its saves would find no
    room); a checkpoint it retires meanwhile is left out (``deleted_meanwhile``)."""
    problems: list[str] = []
    manifests = select_manifests(tier, checkpoint_id, problems)
    try:
        slabs = tier.slab_files()  # slab -> bytes, listed now
    except CheckpointError as exc:  # slabs/ cannot be listed: every chunk is reported below
        problems.append(str(exc))
        slabs = {}
    if on_total is not None:
        on_total(_fast_bytes_to_check(manifests, slabs))
    results: dict[str, str | None] = {}
    checked_chunks = checked_bytes = 0
    for m in manifests:
        found = len(problems)
        for si, storage in enumerate(m.storages):
            total: int | None = 0
            for ci, name in enumerate(storage.chunks):
                try:
                    _h, slab, offset, length = chunk_location(name)
                except IntegrityError as exc:
                    results[name], total = str(exc), None
                else:
                    total = None if total is None else total + length
                    if name not in results:
                        results[name] = _fast_chunk_problem(tier, name, slab, offset + length, slabs.get(slab))
                        if slabs.get(slab, 0) >= offset + length:  # (read and hashed, whatever it found)
                            checked_chunks += 1
                            checked_bytes += length
                            if progress is not None:
                                progress(length)
                if results[name] is not None:
                    problems.append(f"checkpoint {m.id}: storage {si} chunk {ci}: {results[name]}")
            if total is not None and total != storage.nbytes:
                problems.append(
                    f"checkpoint {m.id}: storage {si} chunks hold {total} bytes, the manifest says {storage.nbytes}"
                )
        if len(problems) > found and deleted_meanwhile(tier, m.id):
            del problems[found:]  # the writer's retention retired it (its bytes may be reused)
    return VerifyReport(not problems, tuple(problems), len(manifests), checked_chunks, checked_bytes)


def _fast_bytes_to_check(manifests: list[Manifest], slabs: dict[int, int]) -> int:
    """What :func:`_verify_fast` reports to ``progress``: each distinct chunk its slab is long
    enough to hold (a chunk past its slab's end is missing, not read)."""
    lengths: dict[str, int] = {}
    for m in manifests:
        for storage in m.storages:
            for name in storage.chunks:
                try:
                    _h, slab, offset, length = chunk_location(name)
                except IntegrityError:
                    continue
                if slabs.get(slab, 0) >= offset + length:
                    lengths[name] = length
    return sum(lengths.values())


def _fast_chunk_problem(tier: FastTier, name: str, slab: int, end: int, slab_size: int | None) -> str | None:
    """The problem with fast chunk ``name`` (ending at byte ``end`` of slab ``slab``, whose
    file holds ``slab_size`` bytes or is absent), or None."""
    where = tier.backend.describe(slab_path(slab))
    if slab_size is None:
        return f"chunk {name} is missing: no slab {where}"
    if end > slab_size:
        return f"chunk {name} is missing: slab {where} holds {slab_size} bytes, the chunk ends at {end}"
    try:
        tier.read_chunk(name)
    except CheckpointError as exc:  # IntegrityError (hash, length), StorageError (I/O)
        return str(exc)
    return None
