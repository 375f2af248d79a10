"""Which storages a suspend moves, each once, and where its bytes go in the host copy.

Tensors are grouped by storage identity (the StorageImpl, ``_cdata``): views and tied
weights share one storage and move once, and every tensor on it keeps viewing it. Every
check runs here, before a byte moves; each problem names the tensor's key path.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from gpusnap.errors import CheckpointError
from gpusnap.moving import registry
from gpusnap.moving.reach import Reached
from gpusnap.restore.lazy.gate import storage_of

__all__ = ["ALIGN", "Member", "SuspendPlan", "plan_members", "wanted"]

ALIGN = 512  # bytes: each storage's host copy starts aligned as the CUDA allocator aligns blocks
MAX_LISTED = 8  # problems named in one error


@dataclass(frozen=True, eq=False)
class Member:
    """One storage to move: ``nbytes`` at ``offset`` of the host copy."""

    storage: torch.UntypedStorage
    nbytes: int
    offset: int
    device: torch.device
    paths: tuple[str, ...]  # key paths of the tensors on it, in walk order
    tensors: tuple[weakref.ref[torch.Tensor], ...]  # those tensors (the lazy gate checks their versions)
    pinned: bool  # a page-locked CPU storage (given page-locked memory again at resume)


@dataclass(frozen=True)
class SuspendPlan:
    members: tuple[Member, ...]  # in walk order: the order a lazy resume brings them back
    nbytes: int  # of the host copy, alignment included
    tensors: int  # tensor objects on the members' storages

    @property
    def devices(self) -> tuple[torch.device, ...]:
        return tuple(dict.fromkeys(m.device for m in self.members))


def wanted(device: torch.device, want: torch.device) -> bool:
    """Whether a tensor on ``device`` is moved by a suspend of ``want`` (``cuda``: every
    CUDA device; ``cuda:1``: that one)."""
    return device.type == want.type and (want.index is None or device.index == want.index)


def plan_members(reached: Reached, want: torch.device) -> SuspendPlan:
    """The storages of ``reached``'s tensors on ``want``; CheckpointError naming every
    tensor that cannot be suspended (nothing has moved yet)."""
    problems: list[str] = []
    groups: dict[int, tuple[torch.UntypedStorage, list[str], list[torch.Tensor]]] = {}
    for path, tensor in reached.tensors:
        if not wanted(tensor.device, want):
            continue
        storage = storage_of(tensor) if tensor.layout == torch.strided else None
        if storage is None:
            problems.append(f"{path}: a {tensor.layout} tensor of type {type(tensor).__name__} has no storage of its "
                            f"own to move; keep it out of app_state or make it dense")
            continue
        group = groups.setdefault(storage._cdata, (storage, [], []))
        group[1].append(path)
        group[2].append(tensor)
    members: list[Member] = []
    offset = tensors = 0
    for storage, paths, group in groups.values():
        nbytes = storage.nbytes()
        if registry.holder_of(storage) is not None:
            problems.append(f"{paths[0]}: suspended already (by a suspend() not resumed yet): resume that one first")
            continue
        if nbytes == 0:
            continue  # nothing to move (an empty tensor)
        if not storage.resizable():
            problems.append(
                f"{paths[0]}: its memory is not PyTorch's to free (a tensor made from a pointer, numpy, DLPack or "
                f"CUDA IPC): suspend cannot give it back; keep it out of app_state or copy it into a tensor of its own"
            )
            continue
        offset = -(-offset // ALIGN) * ALIGN
        members.append(Member(storage, nbytes, offset, storage.device, tuple(paths),
                              tuple(weakref.ref(t) for t in group), _pinned(storage)))
        offset += nbytes
        tensors += len(group)
    if problems:
        listed = "; ".join(problems[:MAX_LISTED])
        more = f" (+{len(problems) - MAX_LISTED} more)" if len(problems) > MAX_LISTED else ""
        raise CheckpointError(f"cannot suspend: {listed}{more}. Nothing was moved")
    return SuspendPlan(tuple(members), offset, tensors)


def _pinned(storage: torch.UntypedStorage) -> bool:
    return storage.device.type == "cpu" and torch.cuda.is_available() and storage.is_pinned()
