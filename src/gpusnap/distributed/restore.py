"""A collective restore: every rank restores the same checkpoint, and a rank whose state
does not fit stops every rank before any byte is written (docs/distributed.md).

Call order, all on the calling thread of every rank (agreements through the store, each
bounded by ``Config.collective_timeout_s``, never a collective of the program's group):
rank 0 resolves the checkpoint and tells the others; each rank builds its view
(:func:`~gpusnap.restore.rank_view.rank_view`), gives DTensor optimizers their state
(:func:`~gpusnap.state.dtensor.prime_optimizers`) and plans the restore without writing;
the ranks agree (any rank's error is raised on every rank); the restore runs as any other;
an eager one ends with a last agreement, so that a rank whose bytes failed (a corrupt
chunk) fails every rank.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from gpusnap.distributed.collective import Collective
from gpusnap.errors import CheckpointError
from gpusnap.handles import RestoreHandle
from gpusnap.restore.rank_view import rank_view
from gpusnap.restore.restorer import Restorer
from gpusnap.state.apply import plan_restore
from gpusnap.state.dtensor import prime_optimizers
from gpusnap.state.targets import SpanInfo

__all__ = ["collective_restore"]


def collective_restore(
    collective: Collective, restorer: Restorer, app_state: MutableMapping[str, Any], checkpoint: str | None, *,
    allow_pickle: bool, lazy: bool, verify: Any, strict: bool, started: float,
) -> RestoreHandle:
    manifest = collective.agreed_checkpoint(checkpoint)
    saved_world = manifest.world_size
    repo: Any = collective.root_repository(create=False)
    problem: BaseException | None = None
    primed: list[str] = []
    try:
        if manifest.ranks:
            repo, manifest = rank_view(repo, manifest, rank=collective.rank, world_size=collective.size)
        primed = prime_optimizers(app_state)
        spans = [SpanInfo(nbytes=e.nbytes, device=e.device) for e in manifest.storages]
        plan_restore(app_state, manifest.tree, spans, allow_pickle=allow_pickle, strict=strict)  # checks only
    except CheckpointError as exc:
        problem = exc
    collective.agree(problem, f"planning the restore of {manifest.id}")
    handle: RestoreHandle | None = None
    try:
        handle = restorer.restore(repo, manifest, app_state, allow_pickle=allow_pickle, lazy=lazy, verify=verify,
                                  started=started, strict=strict)
    except CheckpointError as exc:
        problem = exc
    if not lazy:  # (decided by the argument: every rank agrees as often)
        collective.agree(problem, f"restoring {manifest.id}")
    elif problem is not None:
        raise problem
    assert handle is not None
    handle.stats.update(world_size=collective.size, saved_world_size=saved_world, primed_optimizers=primed)
    return handle
