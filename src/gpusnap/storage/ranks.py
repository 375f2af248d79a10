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

from gpusnap.errors import CheckpointError, CheckpointNotFoundError, IntegrityError
from gpusnap.storage.backend import BackendLock
from gpusnap.storage.layout import MANIFESTS, PACKS, RANKS, storage_error
from gpusnap.storage.manifest import Manifest, RankPart
from gpusnap.storage.pack import PackIndex
from gpusnap.storage.repository import Repository
from gpusnap.storage.txn import WriteTxn

__all__ = ["RANK_ROOT_DOC", "RankedRepository", "rank_manifest_path", "rank_root", "retire_rank_manifests"]

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


class RankedRepository(Repository):
    """A root that holds distributed checkpoints (``Repository.open`` returns one when it has
    ``ranks/``). Reads find chunks in every rank's packs; :meth:`rank_manifests` reads a
    checkpoint's parts, each checked against the checksum its global manifest names.
    Writes to the root itself are global manifests only (no chunks)."""

    def _pack_paths(self) -> builtins.list[str]:
        paths = super()._pack_paths()
        for rank in self._listdir(RANKS):
            if rank.isdigit():
                base = f"{RANKS}/{rank}/{PACKS}"
                for fan in self._listdir(base):
                    if len(fan) == 2:
                        paths.extend(f"{base}/{fan}/{n}" for n in self._listdir(f"{base}/{fan}") if n.endswith(".pack"))
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


def retire_rank_manifests(rank_repo: Repository, root_repo: Repository, upto: str) -> builtins.list[str]:
    """A rank's retention: delete its manifests of checkpoints up to ``upto`` (ids sort in save
    order) that have no global manifest (never committed, or retired by rank 0), then the
    packs nothing references. Returns the ids deleted. Saves after ``upto`` are still being
    decided and are kept; a global manifest not yet retired keeps its part until a later run."""
    gone: builtins.list[str] = []
    for m in rank_repo.list():
        if m.id > upto:
            continue
        try:
            committed = root_repo.backend.exists(f"{MANIFESTS}/{m.id}.json")
        except OSError:
            continue  # cannot tell: keep it
        if committed:
            continue
        try:
            rank_repo.delete(m.id, timeout=0.0)
        except CheckpointNotFoundError:
            pass
        gone.append(m.id)
    if gone:
        report = rank_repo.gc(None, blocking=False, fresh=False)
        if report.skipped:
            raise CheckpointError(f"retention of {rank_repo.root} skipped: {'; '.join(report.notes)}")
    return gone
