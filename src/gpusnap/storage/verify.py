"""``verify``: re-hash stored chunks and check pack trailers, from freshly read indexes.

A fast tier's root (``storage/fast_tier.py``) has no packs: each chunk is re-read from its
slab through the tier's own read path and checked against the device hash its name holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpusnap.errors import CheckpointError, CheckpointNotFoundError, IntegrityError, StorageError
from gpusnap.storage.backend import BackendLock
from gpusnap.storage.layout import MANIFESTS, map_chunks, storage_error
from gpusnap.storage.pack import PACK_MAGIC, PackIndex, pack_path, read_pack_index

if TYPE_CHECKING:
    from gpusnap.storage.fast_tier import FastTier
    from gpusnap.storage.manifest import Manifest
    from gpusnap.storage.repository import Repository

__all__ = ["VerifyReport", "verify"]


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of re-hashing stored chunks; ``ok`` is False when ``problems`` is not empty."""

    ok: bool
    problems: tuple[str, ...]
    checked_checkpoints: int
    checked_chunks: int
    checked_bytes: int


def verify(
    repo: Repository, checkpoint_id: str | None = None, *, progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Re-hash every chunk of one checkpoint (id or tag) or of all, and check pack trailers
    (a fast tier: re-read every chunk from its slab and check its device hash).

    ``progress`` is called with each checked chunk's length; ``on_total``, once before the
    first, with what those lengths sum to (a chunk that checkpoints share is checked once, so
    this is less than their sizes added up; a bar over those would stop short).

    Works from freshly read pack indexes, not from what this object remembers. Holds the
    shared lock (best effort) so a concurrent gc cannot pull packs away mid-check; without
    it (a gc held the root longer than verify waits) a chunk whose pack vanished is looked
    up again in a fresh listing, where a compaction put it. A fast tier's verify holds no
    lock, so its writer's retention never waits for it.
    """
    # (imported here: fast_tier imports repository.py, which imports this module)
    from gpusnap.storage.fast_tier import FastTier

    if isinstance(repo, FastTier):
        # No lock: the writer's retention must not wait for a reader (its saves would find
        # no room); a checkpoint it retires meanwhile is left out (_deleted_meanwhile).
        return _verify_fast(repo, checkpoint_id, progress, on_total)
    try:
        lock: BackendLock | None = repo._lock(exclusive=False, timeout=30.0)
    except StorageError:
        lock = None  # read-only media or a long gc: verify anyway, a vanished pack is reported
    try:
        return _verify(repo, checkpoint_id, progress, on_total)
    finally:
        if lock is not None:
            lock.release()


def _selected(repo: Repository, checkpoint_id: str | None, problems: list[str]) -> list[Manifest]:
    """The manifests to check (read afresh); an unreadable one is a problem, not an error."""
    if checkpoint_id is None:
        manifests, bad = repo._scan(fresh=True)
        problems.extend(f"manifest {u.path}: {u.reason}" for u in bad)
        return manifests
    try:
        return [repo.load_manifest(checkpoint_id)]
    except CheckpointNotFoundError:
        return [repo.resolve(checkpoint_id)]  # a tag, or CheckpointNotFoundError
    except CheckpointError as exc:
        problems.append(str(exc))
        return []


def _verify(
    repo: Repository, checkpoint_id: str | None, progress: Callable[[int], None] | None,
    on_total: Callable[[int], None] | None = None,
) -> VerifyReport:
    problems: list[str] = []
    selected = _selected(repo, checkpoint_id, problems)
    manifests = _parts(repo, selected, problems)

    packs: dict[str, PackIndex] = {}
    pack_errors: list[str] = []
    where_is = _index_packs(repo, packs, pack_errors)
    if checkpoint_id is None:
        problems.extend(pack_errors)
    if on_total is not None:  # (what the loop below reports: each chunk a pack holds, once)
        held = {d: where_is[d][2] for m in manifests for st in m.storages for d in st.chunks if d in where_is}
        on_total(sum(held.values()))

    results: dict[str, str | None] = {}
    used_packs: set[str] = set()
    checked_chunks = checked_bytes = 0
    for m in manifests:
        found = len(problems)
        for si, storage in enumerate(m.storages):
            for ci, digest in enumerate(storage.chunks):
                if digest not in results:
                    loc = where_is.get(digest)
                    if loc is None:
                        hint = f" ({len(pack_errors)} pack(s) have unreadable indexes)" if pack_errors else ""
                        results[digest] = f"chunk {digest} is missing: no pack holds it{hint}"
                    else:
                        results[digest] = _verify_chunk(repo, digest, *loc)
                        if results[digest] is _GONE:  # a gc elsewhere deleted or compacted it since
                            where_is = _index_packs(repo, packs, [])
                            loc = where_is.get(digest, loc)
                            results[digest] = _verify_chunk(repo, digest, *loc)
                            if results[digest] is _GONE:
                                results[digest] = f"chunk {digest} is missing: no pack holds it (deleted meanwhile)"
                        used_packs.add(loc[0])
                        checked_chunks += 1
                        checked_bytes += loc[2]
                        if progress is not None:
                            progress(loc[2])
                if results[digest] is not None:
                    problems.append(f"checkpoint {m.id}: storage {si} chunk {ci}: {results[digest]}")
            if all(d in where_is for d in storage.chunks):
                total = sum(where_is[d][2] for d in storage.chunks)
                if total != storage.nbytes:
                    problems.append(
                        f"checkpoint {m.id}: storage {si} chunks hold {total} bytes, "
                        f"the manifest says {storage.nbytes}"
                    )
        if len(problems) > found and _deleted_meanwhile(repo, m.id):
            del problems[found:]  # the writer's retention retired it while this ran

    for path in sorted(packs if checkpoint_id is None else used_packs & set(packs)):
        problems.extend(_verify_pack_header(repo, packs[path]))
    return VerifyReport(not problems, tuple(problems), len(selected), checked_chunks, checked_bytes)


def _parts(repo: Repository, manifests: list[Manifest], problems: list[str]) -> list[Manifest]:
    """``manifests`` with each distributed one replaced by its rank manifests (what holds
    chunks); a rank manifest missing or not the one named is a problem."""
    from gpusnap.storage.ranks import RankedRepository

    out: list[Manifest] = []
    for m in manifests:
        if not m.ranks:
            out.append(m)
        elif not isinstance(repo, RankedRepository):
            problems.append(f"checkpoint {m.id}: distributed, but {repo.root} has no ranks/ directory")
        else:
            for part in m.ranks:
                try:
                    out.append(repo.rank_manifest(m, part))
                except CheckpointError as exc:
                    problems.append(str(exc))
    return out


def _verify_fast(
    tier: FastTier, checkpoint_id: str | None, progress: Callable[[int], None] | None,
    on_total: Callable[[int], None] | None = None,
) -> VerifyReport:
    """:func:`verify` of a fast tier: every chunk of the selected manifests read from its
    slab (``FastTier.read_chunk``, which checks its 128-bit device hash); a chunk whose slab
    is gone or too short is missing. Slab bytes no manifest names are free space, not
    problems (a crashed save's, or a deleted checkpoint's)."""
    from gpusnap.storage.fast_tier import chunk_location

    problems: list[str] = []
    manifests = _selected(tier, checkpoint_id, problems)
    try:
        slabs = tier._slab_list()  # slab -> bytes, listed now
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
        if len(problems) > found and _deleted_meanwhile(tier, m.id):
            del problems[found:]  # the writer's retention retired it (its bytes may be reused)
    return VerifyReport(not problems, tuple(problems), len(manifests), checked_chunks, checked_bytes)


def _fast_bytes_to_check(manifests: list[Manifest], slabs: dict[int, int]) -> int:
    """What :func:`_verify_fast` reports to ``progress``: each distinct chunk its slab is long
    enough to hold (a chunk past its slab's end is missing, not read)."""
    from gpusnap.storage.fast_tier import chunk_location

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
    from gpusnap.storage.fast_tier import slab_path

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


def _deleted_meanwhile(repo: Repository, checkpoint_id: str) -> bool:
    """Whether a checkpoint's manifest is gone: a writer's retention does not wait for
    readers (see ``gc``), so packs of a checkpoint it retires can vanish under a verify."""
    try:
        return not repo.backend.exists(f"{MANIFESTS}/{checkpoint_id}.json")
    except OSError:
        return False


_GONE = "(its pack is gone)"  # the chunk's pack vanished since it was listed: look again


def _index_packs(repo: Repository, packs: dict[str, PackIndex], errors: list[str]) -> dict[str, tuple[str, int, int]]:
    """List the packs now: ``packs`` (path -> index) forgets the vanished ones and gains the
    new ones (a damaged index goes to ``errors``); returns where each chunk is."""
    present = set(repo._pack_paths())
    for path in set(packs) - present:
        del packs[path]
    for path in sorted(present - set(packs)):
        try:
            packs[path] = read_pack_index(repo.backend, path)
        except FileNotFoundError:
            continue
        except IntegrityError as exc:
            errors.append(str(exc))
        except OSError as exc:
            where = repo.backend.describe(path)
            errors.append(str(storage_error(exc, "reading pack index", where, writing=False)))
    where_is: dict[str, tuple[str, int, int]] = {}
    for index in packs.values():
        map_chunks(where_is, index)
    return where_is


def _verify_chunk(repo: Repository, digest: str, path: str, offset: int, length: int) -> str | None:
    """The problem with one chunk, or None (``_GONE`` when its pack no longer exists)."""
    try:
        data = repo.backend.read_range(path, offset, length)
        repo._check(digest, data, path, offset, length, "")
    except FileNotFoundError:
        return _GONE
    except OSError as exc:
        return str(repo._read_error(exc, path, ""))
    except CheckpointError as exc:
        return str(exc)
    return None


def _verify_pack_header(repo: Repository, index: PackIndex) -> list[str]:
    where = repo.backend.describe(index.path)
    out = []
    if not index.path.endswith(pack_path(index.pack_id)):  # (a rank's packs: ranks/<r>/packs/...)
        out.append(f"pack {where}: name does not match its index digest {index.pack_id}")
    try:
        head = repo.backend.read_range(index.path, 0, len(PACK_MAGIC))
    except FileNotFoundError:
        return out  # deleted since its index was read: a writer's retention (see _deleted_meanwhile)
    except OSError as exc:
        return [*out, str(storage_error(exc, "reading pack", where, writing=False))]
    if head != PACK_MAGIC:
        out.append(f"pack {where}: bad header magic {head!r}")
    return out
