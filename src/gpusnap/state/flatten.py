"""Flatten an ``app_state`` mapping into a JSON-able tree plus the storage spans to copy.

Tensors are grouped by storage identity (the StorageImpl behind ``untyped_storage()``), never
by data pointer: views and tied weights share one storage and are stored once, and a freed
storage whose memory the allocator hands out again can never be mistaken for a live one,
because every :class:`StorageSpan` holds references to its tensors until it is dropped.

Call order: ``flatten(app_state)`` once at the consistent point (it calls ``state_dict()``
and encodes plain values synchronously), then copy each ``span.as_bytes()`` out.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..errors import CheckpointError
from .plain import dtype_name, encode_plain, join_path, type_name

__all__ = ["Stateful", "is_stateful", "StorageSpan", "FlatState", "flatten", "tensor_extent", "tensor_problem"]


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()`` (optimizers, schedulers, RNGState)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


def is_stateful(value: object) -> bool:
    """True for instances with callable ``state_dict`` and ``load_state_dict`` (not classes)."""
    if isinstance(value, type):
        return False
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


@dataclass(slots=True, eq=False)  # not frozen: save() builds one per storage, frozen init is slow
class StorageSpan:
    """The bytes ``[start, end)`` of one storage covered by the tensors of ``app_state``.

    ``tensors`` keeps the storage alive (and its memory out of the allocator's hands) for as
    long as the span is referenced; ``paths`` names every tensor on it, for error messages.
    """

    index: int
    storage: torch.UntypedStorage
    device: torch.device
    start: int
    end: int
    tensors: list[torch.Tensor] = field(repr=False)
    paths: list[str]

    @property
    def nbytes(self) -> int:
        """Length of the span in bytes (0 when only empty tensors use the storage)."""
        return self.end - self.start

    def as_bytes(self) -> torch.Tensor:
        """A uint8 tensor on the storage's device aliasing exactly the span (no copy)."""
        out = torch.empty((0,), dtype=torch.uint8, device=self.device)
        return out.set_(self.storage, self.start, (self.nbytes,), (1,))


@dataclass(frozen=True)
class FlatState:
    """The manifest tree of ``app_state`` (``{"t": "dict", ...}``) and its storage spans."""

    tree: dict[str, Any]
    spans: list[StorageSpan]


def tensor_extent(tensor: torch.Tensor) -> tuple[int, int] | None:
    """Byte range ``[first, end)`` of ``tensor`` within its storage; None when it is empty."""
    numel = tensor.numel()
    if numel == 0:
        return None
    item = tensor.element_size()
    first = tensor.storage_offset()
    if tensor.is_contiguous():  # the common case, without a Python loop over dimensions
        return first * item, (first + numel) * item
    last = first + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    return first * item, (last + 1) * item


def flatten(app_state: Mapping[str, Any], *, allow_pickle: bool = False) -> FlatState:
    """Tree and spans of ``app_state``; CheckpointError naming the key path of anything unstorable."""
    if not isinstance(app_state, Mapping):
        raise CheckpointError(f"app_state must be a mapping, got {type_name(app_state)}")
    walker = _Walker(allow_pickle)
    tree = walker.walk_mapping(app_state, "")
    return FlatState(tree=tree, spans=walker.spans.finish())


@dataclass(slots=True)
class _PendingSpan:
    storage: torch.UntypedStorage
    start: int | None = None
    end: int | None = None
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    paths: list[str] = field(default_factory=list)
    nodes: list[tuple[dict[str, Any], int | None]] = field(default_factory=list)


class _SpanTable:
    """Groups tensors by storage; byte offsets are fixed up once every view has been seen."""

    def __init__(self) -> None:
        self._by_storage: dict[int, int] = {}
        self._pending: list[_PendingSpan] = []

    def add(self, tensor: torch.Tensor, path: str, node: dict[str, Any]) -> int:
        storage = tensor.untyped_storage()
        index = self._by_storage.setdefault(storage._cdata, len(self._pending))
        if index == len(self._pending):
            self._pending.append(_PendingSpan(storage))
        span = self._pending[index]
        span.tensors.setdefault(id(tensor), tensor)
        span.paths.append(path)
        extent = tensor_extent(tensor)
        span.nodes.append((node, None if extent is None else extent[0]))
        if extent is not None:
            span.start = extent[0] if span.start is None else min(span.start, extent[0])
            span.end = extent[1] if span.end is None else max(span.end, extent[1])
        return index

    def finish(self) -> list[StorageSpan]:
        spans = []
        for index, pending in enumerate(self._pending):
            start = pending.start or 0
            end = pending.end if pending.end is not None else start
            for node, first in pending.nodes:
                node["byte_offset"] = 0 if first is None else first - start  # empty: no bytes
            spans.append(
                StorageSpan(
                    index=index,
                    storage=pending.storage,
                    device=pending.storage.device,
                    start=start,
                    end=end,
                    tensors=list(pending.tensors.values()),
                    paths=pending.paths,
                )
            )
        return spans


class _Walker:
    """One pass over ``app_state``; ``active`` holds the containers on the current path."""

    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.spans = _SpanTable()
        self.active: set[int] = set()

    def walk(self, value: Any, path: str) -> dict[str, Any]:
        if isinstance(value, torch.Tensor):
            return self.tensor(value, path)
        if isinstance(value, nn.Module):
            return self.module(value, path)
        if is_stateful(value):
            return self.stateful(value, path)
        if isinstance(value, dict):
            return self.guarded(value, path, self.walk_mapping)
        if type(value) in (list, tuple):
            return self.guarded(value, path, self.walk_sequence)
        return encode_plain(value, path, self.allow_pickle)

    def guarded(self, value: Any, path: str, walk: Any) -> dict[str, Any]:
        if id(value) in self.active:
            where = path or "<root>"
            raise CheckpointError(f"{where}: the container refers to itself; a checkpoint cannot hold a cycle")
        self.active.add(id(value))
        try:
            return walk(value, path)
        finally:
            self.active.discard(id(value))

    def walk_mapping(self, value: Mapping[Any, Any], path: str) -> dict[str, Any]:
        items = []
        for key, item in value.items():
            if isinstance(key, torch.Tensor):
                raise CheckpointError(f"{path or '<root>'}: a dict key is a tensor; keys must be plain values")
            key_node = encode_plain(key, join_path(path, key), self.allow_pickle)
            items.append([key_node, self.walk(item, join_path(path, key))])
        return {"t": "dict", "items": items}

    def walk_sequence(self, value: list[Any] | tuple[Any, ...], path: str) -> dict[str, Any]:
        kind = "list" if type(value) is list else "tuple"
        return {"t": kind, "items": [self.walk(item, join_path(path, i)) for i, item in enumerate(value)]}

    def module(self, module: nn.Module, path: str) -> dict[str, Any]:
        # keep_vars: the entries are the Parameters/buffers themselves, not detached aliases,
        # so spans hold the live objects and restore can write into them in place.
        entries = _call_state_dict(module, path, keep_vars=True)
        return {"t": "module", "entries": self.guarded(entries, path, self.walk_mapping)}

    def stateful(self, obj: Any, path: str) -> dict[str, Any]:
        state = _call_state_dict(obj, path)
        return {"t": "stateful", "cls": type_name(obj), "state": self.walk(state, path)}

    def tensor(self, tensor: torch.Tensor, path: str) -> dict[str, Any]:
        seen = _supported.get(id(tensor))
        # a tensor object's kind does not change (`.data =` refuses other tensor types):
        # checked fully once; its device every time, for safety
        if seen is None or seen() is not tensor or tensor.device.type not in ("cpu", "cuda"):
            problem = tensor_problem(tensor)
            if problem is not None:
                raise CheckpointError(f"{path or '<root>'}: unsupported tensor: {problem}")
            if len(_supported) > 1 << 17:
                _supported.clear()  # dead entries of tensors long gone
            _supported[id(tensor)] = weakref.ref(tensor)
        node: dict[str, Any] = {
            "t": "tensor",
            "storage": -1,
            "dtype": _dtype_names.get(tensor.dtype) or _dtype_names.setdefault(tensor.dtype, dtype_name(tensor.dtype)),
            # tuples of ints: Python's collector stops tracking them, so a save that lives
            # for seconds does not bring its next full collection closer (JSON: arrays)
            "shape": tuple(tensor.shape),
            "stride": tensor.stride(),
            "byte_offset": 0,
            "device": _device_names.get(tensor.device) or _device_names.setdefault(tensor.device, str(tensor.device)),
            "requires_grad": bool(tensor.requires_grad),
        }
        node["storage"] = self.spans.add(tensor, path, node)
        return node


def _call_state_dict(obj: Any, path: str, **kwargs: Any) -> Any:
    try:
        return obj.state_dict(**kwargs)
    except Exception as exc:
        raise CheckpointError(f"{path or '<root>'}: {type_name(obj)}.state_dict() failed: {exc!r}") from exc


# save() flattens every tensor of the state each time: per-tensor work is the caller's stall
_dtype_names: dict[torch.dtype, str] = {}
_supported: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> the tensor checked (by identity)
_device_names: dict[torch.device, str] = {}


def tensor_problem(tensor: torch.Tensor) -> str | None:
    """Why gpusnap cannot copy ``tensor``'s bytes, or None when it can."""
    if (
        type(tensor) in (torch.Tensor, nn.Parameter)
        and tensor.layout == torch.strided
        and not (tensor.is_quantized or tensor.is_nested or tensor.is_meta or tensor.is_conj() or tensor.is_neg())
        and tensor.device.type in ("cpu", "cuda")
    ):
        return None  # the common case, decided in one expression (storage access checked in add)
    if isinstance(tensor, nn.parameter.UninitializedTensorMixin):
        return "an uninitialized lazy parameter/buffer; run a forward pass first"
    if type(tensor) not in (torch.Tensor, nn.Parameter):
        return f"tensor subclass {type_name(tensor)} (only torch.Tensor and nn.Parameter are supported)"
    if tensor.is_quantized:
        return f"quantized tensor ({tensor.dtype}); dequantize it or store int_repr() and its scales"
    if tensor.is_nested:
        return "nested tensor"
    if tensor.layout != torch.strided:
        return f"layout {tensor.layout} (only strided tensors; convert with .to_dense())"
    if tensor.is_meta:
        return "meta tensor (it has no data)"
    if tensor.is_conj() or tensor.is_neg():
        return "lazy conjugate/negative view; call .resolve_conj()/.resolve_neg() first"
    try:
        tensor.untyped_storage()
    except Exception as exc:  # functional wrappers, fake tensors: no real storage
        return f"it has no accessible storage ({exc})"
    return None
