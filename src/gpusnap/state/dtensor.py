"""DTensors (``torch.distributed.tensor``, what FSDP2's ``fully_shard`` and tensor parallelism
hold): their manifest node, the box of the global tensor a rank's local tensor holds, and
which placements can be resharded.

A DTensor is stored as its local tensor plus its global layout (``dtensor`` node)::

    {"t": "dtensor", "shape": global, "dtype", "mesh": mesh shape, "placements": ["S(0)", "R", ...],
     "coord": this rank's mesh coordinate, "offset": the local tensor's place in the global
     tensor, "local_shape", "local": its tensor node, or None on a replica that is not primary}

A tensor replicated over some mesh dimensions (``Replicate``) is stored once: by the ranks at
coordinate 0 of those dimensions (*primary*); the others record its layout only and restore
from the primary's bytes. ``Shard(d)`` (even or not) and ``Replicate`` pieces are boxes of the
global tensor, so they reshard into any other such layout; ``Partial`` (pending reduction)
and ``_StridedShard`` (FSDP2 over tensor parallelism) restore only into the layout they
were saved in (:func:`reshardable`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from .plain import dtype_name

__all__ = [
    "Box",
    "box_of",
    "dtensor_type",
    "encode_placements",
    "intersect",
    "is_dtensor",
    "layout_of",
    "prime_optimizers",
    "reshardable",
    "slices",
    "volume",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape) in the global tensor


def dtensor_type() -> type | None:
    """``DTensor`` once ``torch.distributed.tensor`` is imported, else None: no DTensor can
    exist before its module is (importing it costs a process that never meets one over
    half a second, so gpusnap never imports it to ask)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


_dtensor: type | None = None  # (found once: the class never changes)


def is_dtensor(value: object) -> bool:
    global _dtensor
    if _dtensor is None:
        _dtensor = dtensor_type()
        if _dtensor is None:
            return False
    return isinstance(value, _dtensor)


def encode_placements(placements: Any) -> list[str]:
    """``Shard(d)`` -> ``"S(d)"``, ``Replicate`` -> ``"R"``, ``Partial(op)`` -> ``"P(op)"``, anything
    else its repr (``_StridedShard(dim=0, sf=2)``): never resharded."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    out = []
    for p in placements:
        if type(p) is Shard:
            out.append(f"S({p.dim})")
        elif type(p) is Replicate:
            out.append("R")
        elif type(p) is Partial:
            out.append(f"P({p.reduce_op})")
        else:
            out.append(repr(p))
    return out


def reshardable(placements: list[str]) -> bool:
    """Whether each rank's piece under ``placements`` is a box of the global tensor."""
    return all(p == "R" or (p.startswith("S(") and p[2:-1].isdigit()) for p in placements)


_layouts: dict[Any, dict[str, Any]] = {}  # DTensorSpec -> its node without "local": save() meets each once


def layout_of(value: Any) -> dict[str, Any]:
    """The ``dtensor`` node of ``value`` without its ``local`` (shared, read only), and
    ``"primary"``: whether this rank stores the local tensor."""
    spec = value._spec
    node = _layouts.get(spec)
    if node is None:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        mesh = value.device_mesh
        coord = mesh.get_coordinate()
        placements = encode_placements(value.placements)
        local_shape, offset = compute_local_shape_and_global_offset(value.shape, mesh, value.placements)
        primary = coord is not None and all(c == 0 for c, p in zip(coord, placements) if p == "R")
        node = {
            "t": "dtensor", "shape": tuple(value.shape), "dtype": dtype_name(value.dtype),
            "mesh": tuple(mesh.shape), "placements": placements, "coord": tuple(coord or ()),
            "offset": tuple(offset), "local_shape": tuple(local_shape), "primary": primary,
        }
        if len(_layouts) > 1 << 14:
            _layouts.clear()
        _layouts[spec] = node
    return node


def box_of(value: Any) -> Box:
    """Where ``value``'s local tensor sits in its global tensor (a plain tensor: all of it)."""
    if not is_dtensor(value):
        return (0,) * value.dim(), tuple(value.shape)
    node = layout_of(value)
    return node["offset"], node["local_shape"]


def volume(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b`` (global coordinates), or None when they do not meet."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def slices(inner: Box, within: Box) -> tuple[slice, ...]:
    """``inner`` (global coordinates) as slices of the tensor that holds box ``within``."""
    return tuple(slice(o - w, o - w + n) for o, n, w in zip(inner[0], inner[1], within[0]))


def prime_optimizers(app_state: Any) -> list[str]:
    """Give each optimizer of ``app_state`` (its top-level values) that holds DTensor
    parameters and no state yet its state, by one step with zero gradients and zero
    learning rates (what DCP's ``set_optimizer_state_dict`` does): a restore then fills those
    DTensors in place, laid out as their parameters. Returns the keys primed."""
    primed = []
    for key, value in app_state.items():
        if not isinstance(value, torch.optim.Optimizer) or value.state:
            continue
        params = [p for g in value.param_groups for p in g["params"]]
        if not any(is_dtensor(p) for p in params) or any(p.grad is not None for p in params):
            continue
        saved_lr = [g.get("lr") for g in value.param_groups]
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        for g in value.param_groups:
            if "lr" in g:
                g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        try:
            value.step()
        finally:
            for g, lr in zip(value.param_groups, saved_lr):
                if lr is not None:
                    g["lr"] = lr
            value.zero_grad(set_to_none=True)
        primed.append(str(key))
    return primed
