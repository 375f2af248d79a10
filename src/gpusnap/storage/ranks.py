"""A distributed checkpoint on disk: one ordinary root per rank under the root, and global
manifests naming their rank manifests.

Layout (docs/distributed.md)::

    ROOT/manifests/<id>.json               global manifests: the checkpoints (``Manifest.ranks``)
    ROOT/ranks/<r>/                        rank r's own root: packs/, manifests/<id>.json, tmp/, writer
    ROOT/ranks/<r>/manifests/<id>.json     rank r's part of checkpoint <id> (an ordinary manifest)

Each rank writes only its own root (its own writer lease, its own retention and pins), so
no gc ever deletes a pack another process relies on; a checkpoint exists once its global
manifest does, which rank 0 writes last. Readers see every rank's packs through
:class:`RankedRepository`, so a rank may restore bytes another rank stored.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable
from dataclasses import replace

from gpusnap.errors import CheckpointError, CheckpointNotFoundError, IntegrityError
from gpusnap.storage.backend import BackendLock
from gpusnap.storage.layout import MANIFESTS, PACKS, RANKS, storage_error
from gpusnap.storage.manifest import Manifest, RankPart
from gpusnap.storage.pack import PackIndex
from gpusnap.storage.repository import GcReport, Repository, merge_reports
from gpusnap.storage.txn import WriteTxn

__all__ = ["RANK_ROOT_DOC", "RankedRepository", "collect_ranks", "rank_manifest_path", "rank_root",
           "retire_rank_manifests", "whole"]

RANK_ROOT_DOC = {"tier": "rank"}  # a rank's root: refused as a Checkpointer's root or fast_root


def rank_root(root: str | os.PathLike[str], rank: int) -> str:
    """The root rank ``rank`` writes, under ``root`` (a path or an fsspec URL)."""
    base = os.fspath(root)
    if "://" in base:
        return f"{base.rstrip('/')}/{RANKS}/{rank}"
    return os.path.join(base, RANKS, str(rank))


def rank_manifest_path(rank: int, checkpoint_id: str) -> str:
    """Rank ``rank``'s manifest of ``checkpoint_id``, relative to the root."""
    return f"{RANKS}/{rank}/{MANIFESTS}/{checkpoint_id}.json"


class RankedRepository(Repository, root_kind="ranks"):
    """A root that holds distributed checkpoints (``Repository.open`` returns one when it has
    ``ranks/``). Reads find chunks in every rank's packs; :meth:`rank_manifests` reads a
    checkpoint's parts, each checked against the checksum its global manifest names.
    Writes to the root itself are global manifests only (no chunks)."""

    holds_ranks = True

    def pack_paths(self) -> builtins.list[str]:
        paths = super().pack_paths()
        for rank in self.listdir(RANKS):
            if rank.isdigit():
                base = f"{RANKS}/{rank}/{PACKS}"
                for fan in self.listdir(base):
                    if len(fan) == 2:
                        paths.extend(f"{base}/{fan}/{n}" for n in self.listdir(f"{base}/{fan}") if n.endswith(".pack"))
        return paths

    def _collectable(self) -> builtins.list[PackIndex]:
        # the root's own packs only: a rank's packs are its own retention's (rank manifests,
        # which this root's manifests do not list, name their chunks)
        return [i for i in super()._collectable() if i.path.startswith(f"{PACKS}/")]

    def _new_txn(self, lock: BackendLock) -> WriteTxn:
        return WriteTxn(self, lock)  # a global manifest names no chunk: no pack listing to refresh

    def rank_manifests(self, manifest: Manifest) -> builtins.list[Manifest]:
        """Every rank's manifest of the global ``manifest``, in rank order."""
        return [self.rank_manifest(manifest, part) for part in manifest.ranks]

    def rank_manifest(self, manifest: Manifest, part: RankPart) -> Manifest:
        path = rank_manifest_path(part.rank, manifest.id)
        where = self.backend.describe(path)
        try:
            data = self.backend.read_range(path)
        except FileNotFoundError:
            raise IntegrityError(
                f"checkpoint {manifest.id}: rank {part.rank}'s manifest {where} is missing"
            ) from None
        except OSError as exc:
            raise storage_error(exc, "reading rank manifest", where, writing=False) from exc
        rank = Manifest.from_json(data, where)
        if rank.id != manifest.id or rank.checksum != part.checksum:
            raise IntegrityError(
                f"checkpoint {manifest.id}: rank {part.rank}'s manifest {where} is not the one its global "
                "manifest names (checksum differs: replaced or corrupt)"
            )
        return rank


def retire_rank_manifests(
    rank_repo: Repository, root_repo: Repository, upto: str, *, before: str | None = None
) -> builtins.list[str]:
    """A rank's retention: delete its manifests of checkpoints up to ``upto`` (ids sort in save
    order) and before ``before`` (the first save still being decided) that have no global
    manifest (never committed, or retired by rank 0), then the packs nothing references.
    Returns the ids deleted. Later saves are still being decided and are kept; a global
    manifest not yet retired keeps its part until a later run, and so does an unreadable one
    (it exists)."""
    gone = _drop_orphans(rank_repo, root_repo, upto, before=before, timeout=0.0)
    if gone:
        report = rank_repo.gc(None, blocking=False, fresh=False, compact=False)  # (as a Checkpointer's retention)
        if report.skipped:
            raise CheckpointError(f"retention of {rank_repo.root} skipped: {'; '.join(report.notes)}")
    return gone


def collect_ranks(
    root_repo: Repository, *, timeout: float = 30.0, compact: bool = True,
    progress: Callable[[int], Callable[[int], None]] | None = None,
) -> GcReport:
    """``gpusnap gc`` of every rank's root once the global manifests are trimmed: the parts no
    global manifest names, the packs only they used, and (``compact``) the packs mostly
    dead, all in one report (notes name their rank's root). Each rank's root has its own
    writer lease: a rank still saving there refuses it (a StorageError). ``progress``:
    :meth:`Repository.gc`'s, for each rank's compaction in turn."""
    parts: builtins.list[str] = []
    reports: builtins.list[GcReport] = []
    for rank in sorted((n for n in root_repo.listdir(RANKS) if n.isdigit()), key=int):
        sub = Repository.open(rank_root(root_repo.root, int(rank)), config=root_repo.config)
        parts += _drop_orphans(sub, root_repo, None, timeout=timeout)
        report = sub.gc(None, timeout=timeout, compact=compact, progress=progress)
        reports.append(replace(report, notes=tuple(f"{sub.root}: {n}" for n in report.notes)))
    return replace(merge_reports(reports), deleted_checkpoints=tuple(parts))


def _drop_orphans(rank_repo: Repository, root_repo: Repository, upto: str | None, *, timeout: float,
                  before: str | None = None) -> builtins.list[str]:
    """Delete ``rank_repo``'s manifests (up to ``upto``, before ``before``) whose global
    manifest does not exist."""
    gone: builtins.list[str] = []
    for m in rank_repo.list():
        if (upto is not None and m.id > upto) or (before is not None and m.id >= before):
            continue
        try:
            committed = root_repo.backend.exists(f"{MANIFESTS}/{m.id}.json")
        except OSError:
            continue  # cannot tell: keep it
        if committed:
            continue
        try:
            rank_repo.delete(m.id, timeout=timeout)
        except CheckpointNotFoundError:
            pass
        gone.append(m.id)
    return gone


def whole(repo: RankedRepository, manifest: Manifest) -> Manifest:
    """A distributed checkpoint as one manifest, for tools that count bytes and compare
    (``du``, ``diff``): every rank's storages in rank order, under rank 0's tree (whose
    storage indices come first). A per-process one as it is."""
    if not manifest.ranks:
        return manifest
    parts = repo.rank_manifests(manifest)
    storages = tuple(e for part in parts for e in part.storages)
    return Manifest(id=manifest.id, tag=manifest.tag, created=manifest.created, chunk_size=parts[0].chunk_size,
                    storages=storages, tree=parts[0].tree, stats=manifest.stats)
