"""The copies of a suspend and an eager resume, batched per device on its current stream.

Every copy is enqueued on the program's current stream of its device, so it is ordered after
the work the program already enqueued there (the consistent point, as for a save) and before
anything the program enqueues later; one synchronization per device then waits for them all.
A suspend synchronizes the whole device, not just the stream: the memory is about to be
freed, and a kernel still running on another stream could be reading it. On CPU the copies
are plain copies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from gpusnap.errors import CheckpointError
from gpusnap.moving.device_memory import give_back, own_pool
from gpusnap.moving.host_memory import Slab
from gpusnap.moving.members import Member

__all__ = ["allocate", "bytes_of", "synchronize", "to_device", "to_host"]


def bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of ``storage`` (an alias with a version counter of its own)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)  # type: ignore[call-overload]


def host_part(slab: Slab, member: Member) -> torch.Tensor:
    return slab.tensor[member.offset : member.offset + member.nbytes]


def to_host(members: Sequence[Member], slab: Slab) -> None:
    """Copy every member's bytes into the slab; returns once they are all there."""
    for m in members:
        host_part(slab, m).copy_(bytes_of(m.storage), non_blocking=m.device.type == "cuda")
    synchronize({m.device for m in members}, whole_device=True)


def allocate(members: Sequence[Member]) -> list[torch.Tensor]:
    """New memory for each member (uint8, its device), from the program's current stream and
    a pool of the state's own on each CUDA device (``device_memory.own_pool``);
    CheckpointError if the device cannot hold them all (then none is kept)."""
    placed: dict[int, torch.Tensor] = {}
    failed: BaseException | None = None
    for device in dict.fromkeys(m.device for m in members):
        with own_pool(device):
            try:
                for i, m in enumerate(members):
                    if m.device == device:
                        placed[i] = torch.empty(m.nbytes, dtype=torch.uint8, device=m.device, pin_memory=m.pinned)
            except (torch.OutOfMemoryError, RuntimeError) as exc:  # (a failed CPU allocation is a RuntimeError)
                failed = exc  # (caught inside: no traceback frame keeps the pool alive past give_back)
        if failed is not None:
            break
    if failed is not None:
        need = sum(m.nbytes for m in members)
        placed.clear()
        give_back({m.device for m in members})  # what was placed sits in the state's own pool
        raise CheckpointError(
            f"cannot resume: the device has no room for the state's {need} bytes ({failed}). The state stays suspended "
            f"(its tensors keep working from host memory); free device memory and call resume() again"
        ) from failed
    return [placed[i] for i in range(len(members))]


def to_device(members: Sequence[Member], buffers: Sequence[torch.Tensor], slab: Slab) -> None:
    """Copy each member's bytes from the slab into its new memory; returns once they are there.
    Work the program enqueued on any stream before the resume (a write to a suspended tensor)
    is waited for first."""
    synchronize({m.device for m in members}, whole_device=True)
    for m, buffer in zip(members, buffers):
        buffer.copy_(host_part(slab, m), non_blocking=m.device.type == "cuda")
    synchronize({m.device for m in members}, whole_device=False)


def synchronize(devices: Iterable[torch.device], *, whole_device: bool) -> None:
    for device in devices:
        if device.type == "cuda":
            if whole_device:
                torch.cuda.synchronize(device)
            else:
                torch.cuda.current_stream(device).synchronize()
