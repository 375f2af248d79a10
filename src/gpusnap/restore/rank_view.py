"""What one rank restores from a distributed checkpoint: one ordinary manifest (a *view*)
that the restore machinery reads as it reads any other.

The view is a rank manifest's tree and storages (the same rank's when the world size is
the one saved, else rank 0's: state that is not a DTensor is per rank, and with another
world size only rank 0's is there for every rank, as DCP treats it as replicated), with
every ``dtensor`` node given what every rank stored of that tensor:

- ``own``: this rank's own local tensor node (same world size only), which a target laid out
  as saved takes in place, bit-exact (``Partial`` and ``_StridedShard`` need it);
- ``pieces``: ``[{"offset", "shape", "local"}]``, one per box of the global tensor some rank
  stored (``Shard``/``Replicate`` layouts), from which any other layout is cut.

Storages of other ranks' pieces are appended to the view's storage table; chunks are found
in every rank's packs (:class:`~gpusnap.storage.ranks.RankedRepository`).
"""

from __future__ import annotations

from typing import Any

from gpusnap.errors import CheckpointError
from gpusnap.state.dtensor import reshardable
from gpusnap.state.tree import leaves, replace_leaves
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.ranks import RankedRepository
from gpusnap.storage.repository import Repository

__all__ = ["rank_view"]


def rank_view(repo: Repository, manifest: Manifest, *, rank: int, world_size: int) -> tuple[RankedRepository, Manifest]:
    """The repository to read from and the view rank ``rank`` of ``world_size`` restores
    from the global ``manifest``."""
    if not isinstance(repo, RankedRepository):
        raise CheckpointError(f"checkpoint {manifest.id} is distributed, but {repo.root} holds no ranks/ directory")
    parts = repo.rank_manifests(manifest)
    sizes = {m.chunk_size for m in parts}
    if len(sizes) > 1:
        raise CheckpointError(f"checkpoint {manifest.id}: its ranks saved with different chunk sizes {sorted(sizes)}")
    same = world_size == len(parts)
    base_rank = rank if same else 0
    base = parts[base_rank]
    storages = list(base.storages)
    placed: dict[tuple[int, int], int] = {(base_rank, i): i for i in range(len(storages))}

    def local_in_view(r: int, local: dict[str, Any]) -> dict[str, Any]:
        key = (r, int(local["storage"]))
        if key not in placed:
            placed[key] = len(storages)
            storages.append(parts[r].storages[key[1]])
        return {**local, "storage": placed[key]}

    pieces: dict[str, list[dict[str, Any]]] = {}
    for r, part in enumerate(parts):
        for path, leaf in leaves(part.tree):
            if leaf.get("t") != "dtensor" or leaf.get("local") is None or not reshardable(leaf["placements"]):
                continue
            found = pieces.setdefault(path, [])
            box = (list(leaf["offset"]), list(leaf["local_shape"]))
            if all((p["offset"], p["shape"]) != box for p in found):  # (a replica of a box met already)
                found.append({"offset": box[0], "shape": box[1], "local": local_in_view(r, leaf["local"])})

    def with_pieces(path: str, leaf: dict[str, Any]) -> dict[str, Any] | None:
        if leaf.get("t") != "dtensor":
            return None
        own = leaf.get("local") if same else None
        return {**leaf, "own": own, "pieces": pieces.get(path, [])}

    tree = replace_leaves(base.tree, with_pieces)
    view = Manifest(id=manifest.id, tag=manifest.tag, created=manifest.created, chunk_size=base.chunk_size,
                    storages=tuple(storages), tree=tree, stats=dict(base.stats))
    return repo, view
