"""The ranks of one collective Checkpointer, and the store they coordinate through.

Ranks talk through the job's ``torch.distributed`` store (the default group's), never
through a collective of the program's process group: a rank that does not take part must
not leave the others inside a collective. Each Checkpointer uses connections of its own
(``Store.clone``), so a poll of gpusnap's never holds a connection the program's own store
calls need.

Joining (:func:`join`, once, at the first save or restore, on the calling thread): rank 0
publishes this Checkpointer's *run id* (which names its saves, ``<run id>-<n>``, and its keys
in the store) and its root; every other rank waits for it (``Config.collective_timeout_s``)
and checks that it names the same root. Ranks make their collective Checkpointers in the
same order, so the n-th one of a root on every rank meets under one key.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from gpusnap.distributed.poll import poll
from gpusnap.errors import CheckpointError, StorageError
from gpusnap.storage.repository import fresh_id

__all__ = ["Group", "canonical_root", "collective_group", "instance_number", "join"]

_made: Counter[str] = Counter()  # collective Checkpointers made per root in this process
_made_lock = threading.Lock()


@dataclass(frozen=True)
class Group:
    """``rank`` and ``size`` are positions in ``process_group``; ``store`` serves short calls
    from any thread, ``waiter`` the writer thread's polls (one client each)."""

    rank: int
    size: int
    process_group: Any
    run_id: str
    store: Any
    waiter: Any
    root: str  # rank 0's (a rank that names another one refuses to save)


def collective_group(process_group: Any) -> Any:
    """The process group a Checkpointer is collective over, or None (per process):
    ``process_group=False``, or torch.distributed not initialized (then a group is an error)."""
    if process_group is False:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError("process_group was given, but torch.distributed is not initialized")
        return None
    return dist.group.WORLD if process_group is None else process_group


def canonical_root(root: str) -> str:
    return root if "://" in root else os.path.abspath(root)


def instance_number(root: str) -> int:
    """The how-manieth collective Checkpointer of ``root`` this process makes (from 0)."""
    key = canonical_root(root)
    with _made_lock:
        n = _made[key]
        _made[key] += 1
    return n


def join(process_group: Any, root: str, instance: int, timeout_s: float, error: CheckpointError | None = None) -> Group:
    """This Checkpointer's group: rank 0 publishes the run id (or ``error``, what it met
    getting ready: another writer holds the root), the others wait for it."""
    rank, size = dist.get_rank(process_group), dist.get_world_size(process_group)
    base = dist.distributed_c10d._get_default_store()
    members = ",".join(map(str, dist.get_process_group_ranks(process_group)))
    key = f"gpusnap/join/{hashlib.sha1(f'{canonical_root(root)}|{members}'.encode()).hexdigest()[:16]}/{instance}"
    if rank == 0:
        run_id = fresh_id(time.time())
        doc = {"run_id": run_id, "root": canonical_root(root),
               "error": None if error is None else [type(error).__name__, str(error)]}
        base.set(key, json.dumps(doc))
        if error is not None:
            raise error
    else:
        doc = _wait_for(base, key, timeout_s)
        if doc["error"] is not None:
            kind, message = doc["error"]
            raise (StorageError if kind == "StorageError" else CheckpointError)(f"rank 0: {message}")
        run_id = doc["run_id"]
    prefix = f"gpusnap/{run_id}/"
    return Group(rank, size, process_group, run_id, dist.PrefixStore(prefix, base.clone()),
                 dist.PrefixStore(prefix, base.clone()), doc["root"])


def _wait_for(store: Any, key: str, timeout_s: float) -> dict[str, Any]:
    def late() -> CheckpointError:
        return CheckpointError(
            f"rank 0 did not start this collective Checkpointer's first save or restore within "
            f"Config.collective_timeout_s={timeout_s:g} s: every rank calls save() at the same step "
            "(and makes its Checkpointers in the same order)"
        )

    poll(lambda: bool(store.check([key])), timeout_s, late)
    return json.loads(store.get(key).decode())  # type: ignore[no-any-return]
