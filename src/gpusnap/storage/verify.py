"""``verify``: re-hash stored chunks and check pack trailers, from freshly read indexes.

A fast tier's root has no packs: ``storage.verify_fast`` re-reads each chunk from its slab
and checks the device hash its name holds (``FastTier.verify``).
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
    from gpusnap.storage.manifest import Manifest
    from gpusnap.storage.repository import Repository

__all__ = ["VerifyReport", "deleted_meanwhile", "select_manifests", "verify"]


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
    (a fast tier's: ``storage.verify_fast``).

    ``progress`` is called with each checked chunk's length; ``on_total``, once before the
    first, with what those lengths sum to (a chunk that checkpoints share is checked once, so
    this is less than their sizes added up; a bar over those would stop short).

    Works from freshly read pack indexes, not from what this object remembers. Holds the
    shared lock (best effort) so a concurrent gc cannot pull packs away mid-check; without
    it (a gc held the root longer than verify waits) a chunk whose pack vanished is looked
    up again in a fresh listing, where a compaction put it.
    """
    try:
        lock: BackendLock | None = repo.lock_root(exclusive=False, timeout=30.0)
    except StorageError:
        lock = None  # read-only media or a long gc: verify anyway, a vanished pack is reported
    try:
        return _verify(repo, checkpoint_id, progress, on_total)
    finally:
        if lock is not None:
            lock.release()


def select_manifests(repo: Repository, checkpoint_id: str | None, problems: list[str]) -> list[Manifest]:
    """The manifests to check (read afresh); an unreadable one is a problem, not an error."""
    if checkpoint_id is None:
        manifests, bad = repo.scan(fresh=True)
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
    selected = select_manifests(repo, checkpoint_id, problems)
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
        if len(problems) > found and deleted_meanwhile(repo, m.id):
            del problems[found:]  # the writer's retention retired it while this ran

    for path in sorted(packs if checkpoint_id is None else used_packs & set(packs)):
        problems.extend(_verify_pack_header(repo, packs[path]))
    return VerifyReport(not problems, tuple(problems), len(selected), checked_chunks, checked_bytes)


def _parts(repo: Repository, manifests: list[Manifest], problems: list[str]) -> list[Manifest]:
    """``manifests`` with each distributed one replaced by its rank manifests (what holds
    chunks); a rank manifest missing or not the one named is a problem."""
    out: list[Manifest] = []
    for m in manifests:
        if not m.ranks:
            out.append(m)
        elif not repo.holds_ranks:
            problems.append(f"checkpoint {m.id}: distributed, but {repo.root} has no ranks/ directory")
        else:
            for part in m.ranks:
                try:
                    out.append(repo.rank_manifest(m, part))
                except CheckpointError as exc:
                    problems.append(str(exc))
    return out


def deleted_meanwhile(repo: Repository, checkpoint_id: str) -> bool:
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
    present = set(repo.pack_paths())
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
        repo.check_chunk(digest, data, path, offset, length, "")
    except FileNotFoundError:
        return _GONE
    except OSError as exc:
        return str(repo.read_error(exc, path, ""))
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
        return out  # deleted since its index was read: a writer's retention (see deleted_meanwhile)
    except OSError as exc:
        return [*out, str(storage_error(exc, "reading pack", where, writing=False))]
    if head != PACK_MAGIC:
        out.append(f"pack {where}: bad header magic {head!r}")
    return out
