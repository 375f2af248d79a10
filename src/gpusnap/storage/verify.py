"""``verify``: re-hash stored chunks and check pack trailers, from freshly read indexes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpusnap.errors import CheckpointError, CheckpointNotFoundError, IntegrityError, StorageError
from gpusnap.storage.backend import BackendLock
from gpusnap.storage.layout import MANIFESTS, map_chunks, storage_error
from gpusnap.storage.pack import PACK_MAGIC, PackIndex, pack_path, read_pack_index

if TYPE_CHECKING:
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
    repo: Repository, checkpoint_id: str | None = None, *, progress: Callable[[int], None] | None = None
) -> VerifyReport:
    """Re-hash every chunk of one checkpoint (id or tag) or of all, and check pack trailers.

    Works from freshly read pack indexes, not from what this object remembers. Holds the
    shared lock (best effort) so a concurrent gc cannot pull packs away mid-check.
    """
    try:
        lock: BackendLock | None = repo._lock(exclusive=False, timeout=30.0)
    except StorageError:
        lock = None  # read-only media or a long gc: verify anyway, a vanished pack is reported
    try:
        return _verify(repo, checkpoint_id, progress)
    finally:
        if lock is not None:
            lock.release()


def _verify(repo: Repository, checkpoint_id: str | None, progress: Callable[[int], None] | None) -> VerifyReport:
    problems: list[str] = []
    if checkpoint_id is None:
        manifests, bad = repo._scan(fresh=True)
        problems.extend(f"manifest {u.path}: {u.reason}" for u in bad)
    else:
        try:
            manifests = [repo.load_manifest(checkpoint_id)]
        except CheckpointNotFoundError:
            manifests = [repo.resolve(checkpoint_id)]  # a tag, or CheckpointNotFoundError
        except CheckpointError as exc:
            manifests = []
            problems.append(str(exc))

    packs: dict[str, PackIndex] = {}
    pack_errors: list[str] = []
    for path in repo._pack_paths():
        try:
            packs[path] = read_pack_index(repo.backend, path)
        except FileNotFoundError:
            continue
        except IntegrityError as exc:
            pack_errors.append(str(exc))
        except OSError as exc:
            where = repo.backend.describe(path)
            pack_errors.append(str(storage_error(exc, "reading pack index", where, writing=False)))
    where_is: dict[str, tuple[str, int, int]] = {}
    for index in packs.values():
        map_chunks(where_is, index)
    if checkpoint_id is None:
        problems.extend(pack_errors)

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
                        used_packs.add(loc[0])
                        results[digest] = _verify_chunk(repo, digest, *loc)
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

    for path in sorted(packs if checkpoint_id is None else used_packs):
        problems.extend(_verify_pack_header(repo, packs[path]))
    return VerifyReport(not problems, tuple(problems), len(manifests), checked_chunks, checked_bytes)


def _deleted_meanwhile(repo: Repository, checkpoint_id: str) -> bool:
    """Whether a checkpoint's manifest is gone: a writer's retention does not wait for
    readers (see ``gc``), so packs of a checkpoint it retires can vanish under a verify."""
    try:
        return not repo.backend.exists(f"{MANIFESTS}/{checkpoint_id}.json")
    except OSError:
        return False


def _verify_chunk(repo: Repository, digest: str, path: str, offset: int, length: int) -> str | None:
    """The problem with one chunk, or None."""
    try:
        data = repo.backend.read_range(path, offset, length)
        repo._check(digest, data, path, offset, length, "")
    except OSError as exc:
        return str(repo._read_error(exc, path, ""))
    except CheckpointError as exc:
        return str(exc)
    return None


def _verify_pack_header(repo: Repository, index: PackIndex) -> list[str]:
    where = repo.backend.describe(index.path)
    out = []
    if index.path != pack_path(index.pack_id):
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
