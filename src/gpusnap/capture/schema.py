"""Speculation: which tensors an ATen op writes, derived from its schema.

Rules (docs/notes/dispatcher-research.md, section 2):
- arguments annotated ``Tensor(a!)`` / ``Tensor(a!)[]`` (in-place self, ``out=``, foreach and
  fused optimizer lists) are written;
- ops whose schema lies get a static override (BatchNorm running stats in training, c10d
  collectives, embedding renorm);
- an in-place-named op (``foo_``) with no annotation at all writes every tensor argument;
- metadata-only ops (``record_stream``, views like ``transpose_``) write no bytes.
The per-op answer is cached: the hot path is one dict lookup and a short loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["leaf_tensors", "tensor_args", "writes_nothing", "written_tensors"]

# (position, name, kwarg_only) of each written argument, per OpOverload.
_Slot = tuple[int, str, bool]
_CACHE: dict[Any, tuple[_Slot, ...] | None] = {}  # None: every tensor argument is written

_NO_BYTES_WRITTEN = {"record_stream", "detach_", "transpose_", "t_", "squeeze_", "unsqueeze_",
                     "swapdims_", "swapaxes_", "as_strided_", "set_"}
# Training-mode ops that update running statistics without a write annotation.
_RUNNING_STATS = {"native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm",
                  "_batch_norm_impl_index", "batch_norm", "instance_norm", "_native_batch_norm_legit"}
_RUNNING_STAT_ARGS = ("running_mean", "running_var")


def _slots(func: Any) -> tuple[_Slot, ...] | None:
    cached = _CACHE.get(func, ())
    if cached != ():
        return cached  # type: ignore[return-value]
    schema = func._schema
    short = schema.name.split("::")[-1]
    namespace = schema.name.split("::")[0]
    slots: tuple[_Slot, ...] | None
    if short in _NO_BYTES_WRITTEN:
        slots = ()
    else:
        found = [
            (i, a.name, a.kwarg_only)
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        ]
        if short in _RUNNING_STATS:
            found += [(i, a.name, a.kwarg_only) for i, a in enumerate(schema.arguments)
                      if a.name in _RUNNING_STAT_ARGS]
        if not found and (short.endswith("_") or namespace == "c10d") and not short.startswith("_local"):
            slots = None  # schema says nothing about an in-place op: assume the worst
        else:
            slots = tuple(found)
    _CACHE[func] = slots
    return slots


def leaf_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Plain tensors inside ``value`` (lists/tuples flattened, wrapper subclasses unwrapped)."""
    if isinstance(value, torch.Tensor):
        if is_traceable_wrapper_subclass(value):
            names, _ = value.__tensor_flatten__()  # type: ignore[attr-defined]
            for name in names:
                yield from leaf_tensors(getattr(value, name))
        else:
            yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from leaf_tensors(v)


def tensor_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """Every tensor an op receives."""
    yield from leaf_tensors(args)
    yield from leaf_tensors(tuple(kwargs.values()))


def writes_nothing(func: Any) -> bool:
    """True when ``func``'s schema writes no argument (most ops: they only make new tensors).

    The tracker's hot path: one dict lookup once ``func`` has been seen.
    """
    return _slots(func) == ()


def written_tensors(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors ``func(*args, **kwargs)`` may write, conservatively."""
    slots = _slots(func)
    if slots is None:
        return list(tensor_args(args, kwargs))
    out: list[torch.Tensor] = []
    for index, name, kwarg_only in slots:
        value = kwargs.get(name) if (kwarg_only or index >= len(args)) else args[index]
        if value is not None:
            out.extend(leaf_tensors(value))
    return out
