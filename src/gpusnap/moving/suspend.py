"""``suspend(app_state)``: free the device memory of a state and keep its Python objects.

Call order (each step either completes or leaves the program's state as it was)::

    reach(app_state)                 every tensor reachable, and CUDA graphs (moving.reach)
    plan_members(...)                its storages on the device, each once; every check
    refuse_graphs(...)               a CUDA graph could replay over the freed memory
    host_memory.take(nbytes)         one page-locked slab (kept from an earlier suspend if it fits)
    copies.to_host(...)              device -> slab, on the current streams; one device sync
    before_swap(...)                 an open save window protects those spans first
    exchange_all(storage <-> alias)  each storage now points at its bytes in the slab
    drop the aliases                 the device memory goes back to the caching allocator,
    device_memory.give_back          and from it to the driver (torch.cuda.empty_cache)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from gpusnap.capture.swap_guard import before_swap
from gpusnap.errors import CheckpointError
from gpusnap.moving import device_memory, host_memory, registry
from gpusnap.moving.copies import to_host
from gpusnap.moving.graphs import refuse_graphs
from gpusnap.moving.lazy_resume import reap_finished
from gpusnap.moving.members import plan_members
from gpusnap.moving.reach import reach
from gpusnap.moving.stats import SuspendStats
from gpusnap.moving.suspended import Core, Parked, Suspended
from gpusnap.moving.swap import exchange_all, host_alias, missing_support
from gpusnap.restore import active
from gpusnap.state.plain import type_name

__all__ = ["suspend"]


def suspend(
    app_state: Mapping[str, Any],
    *,
    device: torch.device | str | None = None,
    reuse_host_memory: bool = True,
    allow_cuda_graphs: bool = False,
) -> Suspended:
    """Move every ``device`` tensor of ``app_state`` to page-locked host memory and free its
    device memory; the Python objects stay (same tensors, same Parameters, views keep
    viewing, tied weights stay tied). ``Suspended.resume()`` brings the bytes back.

    Reaches modules (parameters, gradients, buffers, non-persistent ones too), optimizers'
    state, tensors, KV caches and other objects holding tensors (an HF ``DynamicCache``),
    nested in dicts, lists and tuples. ``device``: whose tensors move: ``"cuda"`` (every
    CUDA device) or one device; default ``"cuda"`` where CUDA is available, else ``"cpu"``
    (the same mechanism over host memory). ``reuse_host_memory``: after ``resume()`` keep
    the page-locked memory for the next suspend (page-locking is slow, BENCHMARKS.md measures it;
    ``gpusnap.moving.release_host_memory()`` lets it go). ``allow_cuda_graphs``: go on
    even though CUDA graphs that captured the state's addresses exist (the program then
    captures them again after ``resume()``; see ``gpusnap.moving.graphs``).

    Call it between steps: work already enqueued on the current stream is waited for, but
    no other thread may use the state while ``suspend()`` or ``resume()`` runs. Raises
    ``CheckpointError`` (nothing moved) for a tensor it cannot free (one whose memory is not
    PyTorch's, a sparse one, one suspended already), a CUDA graph, or too little host memory.

    Example::

        s = gpusnap.suspend({"model": model, "optim": optimizer, "cache": kv_cache})
        print(s.stats.device_freed_bytes)     # another process may use that memory now
        s.resume()                            # the same tensor objects hold the same bytes
    """
    started = time.perf_counter()
    if not isinstance(app_state, Mapping):
        raise CheckpointError(f"suspend(): app_state must be a mapping, got {type_name(app_state)}")
    unsupported = missing_support()
    if unsupported is not None:
        raise CheckpointError(f"cannot suspend: {unsupported}")
    want = _device(device)
    reap_finished()
    registry.sweep()
    active.wait_for_loads()  # a lazy restore or resume may still be writing these tensors
    reached = reach(app_state)
    plan = plan_members(reached, want)
    if not allow_cuda_graphs:
        refuse_graphs(reached.graphs, plan.devices or (want,))
    pinned = want.type == "cuda"
    slab, reused, alloc_s = host_memory.take(plan.nbytes, pinned=pinned) if plan.members else (None, False, 0.0)
    storages = [m.storage for m in plan.members]
    try:
        if slab is not None:
            to_host(plan.members, slab)
        before = device_memory.read(plan.devices)
        before_swap(storages)
        aliases = [host_alias(slab.address + m.offset, m.nbytes, m.device) for m in plan.members]  # type: ignore[union-attr]
        exchange_all(list(zip(storages, aliases)))
    except BaseException:
        if slab is not None and reuse_host_memory:
            host_memory.keep(slab)
        raise
    parked = [Parked(StorageWeakRef(m.storage), m.storage._cdata, m.nbytes, m.offset, m.device, m.paths, m.tensors,
                     m.pinned, slab.address + m.offset) for m in plan.members]  # type: ignore[union-attr]
    stats = SuspendStats(bytes=sum(m.nbytes for m in plan.members), storages=len(plan.members), tensors=plan.tensors,
                         suspend_s=0.0, host_alloc_s=alloc_s, host_reused=reused, pinned=slab is not None and slab.pinned,
                         device_freed_bytes=0, allocator_released_bytes=0)
    core = Core(parked, slab, reuse_host_memory, stats)
    registry.add(core, storages)
    del aliases, plan, storages  # the device memory is the caching allocator's again
    devices = list(dict.fromkeys(p.device for p in parked))
    device_memory.give_back(devices)
    after = device_memory.read(devices)
    freed = after.free - before.free if pinned else stats.bytes
    core.stats = dataclasses.replace(stats, device_freed_bytes=freed, allocator_released_bytes=before.reserved - after.reserved,
                                     suspend_s=time.perf_counter() - started)
    return Suspended(core)


def _device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    want = torch.device(device)
    if want.type not in ("cuda", "cpu"):
        raise CheckpointError(f"suspend(): device must be a CUDA device or 'cpu', got {want}")
    return want
