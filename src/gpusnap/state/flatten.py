"""Flatten an ``app_state`` mapping into a JSON-able tree plus the storage spans to copy.

Tensors are grouped by storage identity (the StorageImpl behind ``untyped_storage()``), never
by data pointer: views and tied weights share one storage and are stored once, and a freed
storage whose memory the allocator hands out again can never be mistaken for a live one,
because every :class:`StorageSpan` holds references to its tensors until it is dropped.

Call order: ``flatten(app_state)`` once at the consistent point (it calls ``state_dict()``
and encodes plain values synchronously), then copy each ``span.as_bytes()`` out.

The per-tensor work (tree node, storage grouping, byte extents) is most of ``save()``'s host
time for a model of a few thousand tensors. It depends only on each tensor's *layout*: which
earlier tensor of the walk (if any) shares its storage, the storage's size, the tensor's
offset, shape, stride, dtype, device, ``requires_grad`` and type; not on which storage it
is. ``flatten(..., plan=previous.plan)`` compares the layouts of this walk with the previous
one's (a :class:`FlatPlan`, which holds no tensor: nothing is kept alive by it) and, when
every one matches, in order, fills the nodes and builds the spans from the plan and the
walk's own tensors instead of working them out again. So a state dict that hands out fresh
tensors each call (``RNGState``) still matches. Any other difference (a new parameter, a
view onto another tensor's storage, a storage resized, ``requires_grad`` flipped) takes the
full path. Plain values are encoded on every walk.
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

__all__ = [
    "FlatPlan",
    "FlatState",
    "Stateful",
    "StorageSpan",
    "flatten",
    "is_stateful",
    "tensor_extent",
    "tensor_problem",
]


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
        # new_empty on a per-device template: ~1.5 us less than torch.empty(device=...) per
        # span, paid for every span of every save
        template = _uint8_templates.get(self.device)
        if template is None:
            template = _uint8_templates[self.device] = torch.empty((0,), dtype=torch.uint8, device=self.device)
        return template.new_empty(0).set_(self.storage, self.start, (self.nbytes,), (1,))


@dataclass(frozen=True, eq=False)
class FlatPlan:
    """What a walk worked out per tensor, keyed by the tensors' layouts (see the module
    docstring). Holds ints, types and strings only: no tensor, no storage."""

    layouts: list[tuple[Any, ...]]  # per tensor leaf, in walk order
    nodes: list[dict[str, Any]]  # per tensor leaf: its finished tree node (copied into each walk's own)
    spans: list[tuple[list[int], int, int]]  # per span: (its leaves, start, end)


@dataclass(frozen=True)
class FlatState:
    """The manifest tree of ``app_state`` (``{"t": "dict", ...}``) and its storage spans;
    ``plan`` speeds up the next ``flatten`` of a state laid out the same way."""

    tree: dict[str, Any]
    spans: list[StorageSpan]
    plan: FlatPlan | None = None
    planned: bool = False  # whether this walk reused the plan it was given


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


def flatten(app_state: Mapping[str, Any], *, allow_pickle: bool = False, plan: FlatPlan | None = None) -> FlatState:
    """Tree and spans of ``app_state``; CheckpointError naming the key path of anything unstorable.

    ``plan``: the previous result's ``plan``; reused when every tensor is laid out as then.
    """
    if not isinstance(app_state, Mapping):
        raise CheckpointError(f"app_state must be a mapping, got {type_name(app_state)}")
    walker = _Walker(allow_pickle, plan)
    tree = walker.walk_mapping(app_state, "")
    if plan is not None and walker.matching and len(walker.tensors) == len(plan.layouts):
        return FlatState(tree=tree, spans=walker.spans_from(plan), plan=plan, planned=True)
    spans = walker.spans_in_full()
    return FlatState(tree=tree, spans=spans, plan=walker.plan(spans))


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

    def __init__(self, allow_pickle: bool, plan: FlatPlan | None = None) -> None:
        self.allow_pickle = allow_pickle
        self.active: set[int] = set()
        # per tensor leaf, in walk order (parallel lists: no tuple per leaf to collect later)
        self.tensors: list[torch.Tensor] = []
        self.paths: list[str] = []
        self.nodes: list[dict[str, Any]] = []  # filled at the end, in full or from the plan
        self._layouts = plan.layouts if plan is not None else None
        self.matching = plan is not None  # every leaf so far laid out as in the plan
        self._groups: dict[int, int] = {}  # storage -> its first leaf's storage group

    # -- after the walk: the per-tensor work, done in full or taken from a plan ------------------
    def spans_in_full(self) -> list[StorageSpan]:
        table = _SpanTable()
        for tensor, path, node in zip(self.tensors, self.paths, self.nodes):
            node.update(
                {
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
            )
            node["storage"] = table.add(tensor, path, node)
        return table.finish()

    def plan(self, spans: list[StorageSpan]) -> FlatPlan:
        members: list[list[int]] = [[] for _ in spans]
        for i, node in enumerate(self.nodes):
            members[node["storage"]].append(i)
        groups: dict[int, int] = {}
        return FlatPlan(
            layouts=[_layout(t, groups) for t in self.tensors],
            nodes=[dict(node) for node in self.nodes],
            spans=[(members[span.index], span.start, span.end) for span in spans],
        )

    def spans_from(self, plan: FlatPlan) -> list[StorageSpan]:
        for node, done in zip(self.nodes, plan.nodes):
            node.update(done)
        tensors, paths = self.tensors, self.paths
        spans = []
        for index, (members, start, end) in enumerate(plan.spans):
            first = tensors[members[0]]
            if len(members) == 1:
                held, named = [first], [paths[members[0]]]
            else:  # views and tied weights: each tensor object once
                held = list({id(tensors[i]): tensors[i] for i in members}.values())
                named = [paths[i] for i in members]
            storage = first.untyped_storage()
            spans.append(StorageSpan(index, storage, storage.device, start, end, held, named))
        return spans

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
            where = join_path(path, key)
            key_node = _key_node(key) if type(key) is str else encode_plain(key, where, self.allow_pickle)
            items.append((key_node, self.walk(item, where)))  # a tuple: untracked by the collector once built
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
        if self.matching:
            layouts = self._layouts
            assert layouts is not None
            i = len(self.tensors)
            if i >= len(layouts) or layouts[i] != _layout(tensor, self._groups):
                self.matching = False
        node: dict[str, Any] = {"t": "tensor"}
        self.tensors.append(tensor)
        self.paths.append(path)
        self.nodes.append(node)
        return node


def _layout(tensor: torch.Tensor, groups: dict[int, int]) -> tuple[Any, ...]:
    """Everything a tensor's node and its span grouping are worked out from (module docstring);
    ``groups`` numbers the walk's storages in order of first appearance."""
    storage = tensor.untyped_storage()
    return (
        type(tensor),
        groups.setdefault(storage._cdata, len(groups)),
        storage.nbytes(),
        tensor.storage_offset(),
        tensor.shape,
        tensor.stride(),
        tensor.dtype,
        tensor.device,
        tensor.requires_grad,
    )


def _key_node(key: str) -> dict[str, Any]:
    """The node of a str dict key, shared by every tree that has it (trees are only read once
    built): parameter names repeat in every save."""
    node = _str_nodes.get(key)
    if node is None:
        if len(_str_nodes) > 1 << 16:
            _str_nodes.clear()
        node = _str_nodes[key] = {"t": "v", "v": key}
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
_str_nodes: dict[str, dict[str, Any]] = {}
_uint8_templates: dict[torch.device, torch.Tensor] = {}


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
