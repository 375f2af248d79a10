"""The walk behind :func:`~gpusnap.state.flatten.flatten`: in full (``walk*``), or along a
plan's recorded container shapes (``replay*``), then the spans worked out in full or taken
from the plan. The module docstring of :mod:`gpusnap.state.flatten` says what is reused when."""

from __future__ import annotations

import operator
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import chain, compress, count, repeat
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from .dtensor import is_dtensor, layout_of
from .flat import FlatPlan, StorageSpan, _Replay, is_stateful, shrunk_storage_error, tensor_extent, tensor_problem
from .plain import dtype_name, encode_plain, join_path, type_name


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
            # A storage the program shrank or freed (resize_, as FSDP does) under tensors that
            # still reach past its end: refused here, before any copy reads it by address
            # (planned walks compare every storage's size with this walk's, see same_layouts)
            have = pending.storage.nbytes()
            if have < end:
                raise shrunk_storage_error(pending.paths, end, have)
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


# How an item of a container was walked (a shape's ``kinds``); or the item's own shape when it
# is a container walked alike (dict, list, tuple, module, Stateful).
_TENSOR = "tensor"  # a tensor leaf
_SCALAR = "scalar"  # None, bool, int, str: {"t": "v", "v": value}, what encode_plain makes of them
_ENCODE = "encode"  # float, bytes, dtype, device, Size: encode_plain, which cannot fail on them
_WALK = "walk"  # anything else (pickled values, containers of other types): the full walk
_SCALAR_TYPES = frozenset({type(None), bool, int, str})
_TENSOR_TYPES = frozenset({torch.Tensor, nn.Parameter})  # the only ones tensor_problem accepts
_ENCODE_TYPES = frozenset({float, bytes, torch.dtype, torch.device, torch.Size})
# Containers whose keys()/values() are what items() walks; keys equal and of the same exact type
# as before have the same key node and path (True == 1 and 1.0 == 1: the type is compared too).
_SHAPED_MAPPINGS = frozenset({dict, OrderedDict})
_SHAPED_KEYS = frozenset({str, int})


# Shapes are never changed once made (not frozen: a full walk makes one per container, and
# frozen init is slow).
@dataclass(slots=True, eq=False)
class _MapShape:
    """A dict as walked: its keys, in order, and per item its exact type, how it was walked and
    its path. ``tensors``: every item is a tensor leaf (a state_dict), taken in one go."""

    keys: tuple[Any, ...]
    key_types: tuple[type, ...]
    key_nodes: tuple[dict[str, Any], ...]
    types: tuple[type, ...]
    kinds: tuple[Any, ...]
    paths: tuple[str, ...]
    tensors: bool
    rows: _Rows | None = None  # every item a dict of tensors with the same keys (optimizer state)


@dataclass(slots=True, eq=False)
class _Rows:
    """The items of a dict of dicts of tensors, all with the same keys and item types (an
    optimizer's ``state``): their tensors are taken in one go. Per-row columns, concatenated."""

    sizes: list[int]  # each row's number of keys
    keys: list[Any]
    key_nodes: tuple[dict[str, Any], ...]  # one row's
    key_types: list[type]
    types: list[type]
    paths: tuple[str, ...]


@dataclass(slots=True, eq=False)
class _SeqShape:
    """A list or tuple as walked; ``paths`` is None when every item is a scalar (no path needed)."""

    kind: str  # "list" or "tuple": the node's "t"
    types: tuple[type, ...]
    kinds: tuple[Any, ...]
    paths: tuple[str, ...] | None
    tensors: bool


@dataclass(slots=True, eq=False)
class _ModuleShape:
    entries_type: type  # what state_dict(keep_vars=True) returned
    entries: _MapShape


@dataclass(slots=True, eq=False)
class _StatefulShape:
    cls: str  # the node's "cls"
    state_type: type  # what state_dict() returned
    state: Any  # how that was walked: a kind or a shape


_Shape = _MapShape | _SeqShape | _ModuleShape | _StatefulShape


class _Walker:
    """One pass over ``app_state``; ``active`` holds the containers on the current path.

    ``walk*`` walk anything in full and note each container's shape; ``replay*`` follow the
    plan's shapes and fall back to ``walk*`` for the first container that differs."""

    def __init__(self, allow_pickle: bool, plan: FlatPlan | None = None) -> None:
        self.allow_pickle = allow_pickle
        self.active: set[int] = set()
        # per tensor leaf, in walk order (parallel lists: no tuple per leaf to collect later)
        self.tensors: list[torch.Tensor] = []
        self.paths: list[str] = []
        self.nodes: list[dict[str, Any]] = []  # the plan's, or filled in full at the end
        self.shapes: dict[int, _Shape] = {}  # id(container node) -> its shape (every node is alive)
        self.fallbacks = 0  # containers replay* handed to walk*
        # a leaf's node is the plan's node of its index, shared (trees are only read once built);
        # kept when every layout matches, else swapped for a new one (unshare)
        self._ready = plan.nodes if plan is not None else []
        self._made = plan.replay.made if plan is not None else {}
        self.noting = plan is not None  # note each container's shape, for plan.replay
        self.made: list[tuple[Any, Any]] = []  # for plan.replay.made, if this walk matches it

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

    def plan(self, spans: list[StorageSpan], replay: _Replay) -> FlatPlan:
        tensors = self.tensors
        members: list[list[int]] = [[] for _ in spans]
        for i, node in enumerate(self.nodes):
            members[node["storage"]].append(i)
        storages = list(map(torch.Tensor.untyped_storage, tensors))
        return FlatPlan(
            types=list(map(type, tensors)),
            attrs=list(map(_ATTRS, tensors)),
            offsets=list(map(torch.Tensor.storage_offset, tensors)),
            strides=list(map(torch.Tensor.stride, tensors)),
            nbytes=list(map(torch.UntypedStorage.nbytes, storages)),
            nodes=self.nodes,  # shared with this walk's tree
            spans=[members[span.index] for span in spans],
            shared=[span.index for span in spans if len(members[span.index]) > 1],
            refs=list(map(weakref.ref, tensors)),
            paths=self.paths,
            named=[span.paths for span in spans],
            firsts=[members[span.index][0] for span in spans],
            devices=[span.device for span in spans],
            starts=[span.start for span in spans],
            ends=[span.end for span in spans],
            replay=replay,
        )

    def root(self, app_state: Mapping[str, Any], tree: dict[str, Any]) -> tuple[type, _MapShape] | None:
        shape = self.shapes.get(id(tree))
        return None if shape is None else (type(app_state), shape)  # type: ignore[return-value]

    def unshare(self, tree: dict[str, Any], plan: FlatPlan) -> dict[str, Any]:
        """``tree`` with the plan's nodes (in ``nodes`` too) swapped for new ones, to be worked
        out in full; the containers on the way are copied, never changed (the plan's own)."""
        new: dict[int, dict[str, Any]] = {}
        for i, (node, planned) in enumerate(zip(self.nodes, plan.nodes)):
            if node is planned:
                self.nodes[i] = new[id(node)] = {"t": "tensor"}
        return _swapped(tree, new) if new else tree

    def same_layouts(self, plan: FlatPlan) -> list[torch.UntypedStorage] | None:
        """Each leaf's storage when every leaf is laid out as in ``plan``, else None. Checks
        first that every tensor is supported (raising as ``tensor`` does).

        A column of tuples is compared as it is read (``all(map(eq, ...))``): none stays alive,
        so the walk brings no collection of the young generation closer."""
        tensors, paths = self.tensors, self.paths
        n = len(tensors)
        # the plan's tensors were checked supported then: any other (replay* leaves them to
        # here) is checked now, in walk order
        if len(plan.refs) != n or not all(map(operator.is_, map(_deref, plan.refs), tensors)):
            same = list(map(operator.is_, map(_deref, plan.refs), tensors))
            same += repeat(False, n - len(same))
            for i in compress(range(n), map(operator.not_, same)):
                _check_supported(tensors[i], paths[i])
        if any(map(torch.Tensor.is_neg, tensors)) or any(map(torch.Tensor.is_conj, tensors)):
            for tensor, path in zip(tensors, paths):  # a known tensor given a lazy view by `.data =`
                _check_supported(tensor, path)
        eq = operator.eq
        if (
            n != len(plan.types)
            or list(map(type, tensors)) != plan.types
            or not all(map(eq, map(_ATTRS, tensors), plan.attrs))  # the plan's devices are supported
        ):
            for tensor, path in zip(tensors, paths):  # a known tensor moved to another device?
                if tensor.device.type not in _DEVICE_TYPES:
                    _check_supported(tensor, path)
            return None
        if list(map(torch.Tensor.storage_offset, tensors)) != plan.offsets:
            return None
        if not all(map(eq, map(torch.Tensor.stride, tensors), plan.strides)):
            return None
        storages = list(map(torch.Tensor.untyped_storage, tensors))
        # the same partition into storages: the leaves of each span of the plan on one storage,
        # and as many storages as the plan has spans
        if len(set(map(_CDATA, storages))) != len(plan.spans):
            return None
        for index in plan.shared:
            members = plan.spans[index]
            first = storages[members[0]]._cdata
            if any(storages[i]._cdata != first for i in members):
                return None
        if list(map(torch.UntypedStorage.nbytes, storages)) != plan.nbytes:
            return None
        return storages

    def spans_from(self, plan: FlatPlan, storages: list[torch.UntypedStorage]) -> list[StorageSpan]:
        tensors, paths = self.tensors, self.paths
        # a span's device is its first tensor's, as in the plan (set_ refuses a storage on
        # another device than the tensor's)
        firsts = plan.firsts
        if paths == plan.paths:  # the plan's lists of paths serve (read only, like the tree)
            named: Any = plan.named
        else:  # keys renamed: the plan is followed all the same
            named = [[path] for path in map(paths.__getitem__, firsts)]
        spans = [
            StorageSpan(index, storage, device, start, end, [tensor], names)
            for index, storage, device, start, end, tensor, names in zip(
                count(), map(storages.__getitem__, firsts), plan.devices, plan.starts, plan.ends, map(tensors.__getitem__, firsts), named
            )
        ]
        for index in plan.shared:  # views and tied weights: each tensor object once
            members = plan.spans[index]
            spans[index].tensors = list({id(tensors[i]): tensors[i] for i in members}.values())
            spans[index].paths = named[index] if named is plan.named else [paths[i] for i in members]
        return spans

    # -- the full walk ------------------------------------------------------------------------
    def walk(self, value: Any, path: str) -> dict[str, Any]:
        if isinstance(value, torch.Tensor):
            if type(value) not in _TENSOR_TYPES and is_dtensor(value):
                return self.dtensor(value, path)
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
        self.enter(value, path)
        try:
            return walk(value, path)
        finally:
            self.active.discard(id(value))

    def enter(self, value: Any, path: str) -> None:
        if id(value) in self.active:
            where = path or "<root>"
            raise CheckpointError(f"{where}: the container refers to itself; a checkpoint cannot hold a cycle")
        self.active.add(id(value))

    def walk_mapping(self, value: Mapping[Any, Any], path: str) -> dict[str, Any]:
        noted = self.noting and type(value) in _SHAPED_MAPPINGS
        entries = list(value.items()) if noted else value.items()  # noted: as walked
        items = []
        wheres: list[str] | None = [] if noted else None
        for key, item in entries:
            if isinstance(key, torch.Tensor):
                raise CheckpointError(f"{path or '<root>'}: a dict key is a tensor; keys must be plain values")
            where = join_path(path, key)
            key_node = _key_node(key) if type(key) is str else encode_plain(key, where, self.allow_pickle)
            items.append((key_node, self.walk(item, where)))  # a tuple: untracked by the collector once built
            if wheres is not None:
                wheres.append(where)
        node = {"t": "dict", "items": items}
        if wheres is not None:
            keys, values = zip(*entries) if entries else ((), ())
            key_nodes, nodes = zip(*items) if items else ((), ())
            self.note_mapping(node, keys, values, key_nodes, nodes, tuple(wheres))
        return node

    def note_mapping(
        self,
        node: dict[str, Any],
        keys: tuple[Any, ...],
        values: tuple[Any, ...] | list[Any],
        key_nodes: tuple[dict[str, Any], ...],
        nodes: tuple[dict[str, Any], ...] | list[dict[str, Any]],
        paths: tuple[str, ...],
    ) -> None:
        key_types = tuple(map(type, keys))
        if not _SHAPED_KEYS.issuperset(key_types):
            return  # walked in full every time
        types = tuple(map(type, values))
        if _TENSOR_TYPES.issuperset(types):  # a state_dict (walk refused any other tensor type)
            kinds: tuple[Any, ...] = (_TENSOR,) * len(values)
            tensors = True
        else:
            kinds = tuple(map(self.kind, values, nodes))
            tensors = False
        rows = None
        if not tensors and types[0] is dict and set(types) == {dict}:
            first = kinds[0]
            if type(first) is _MapShape and first.tensors and first.keys and all(
                type(k) is _MapShape and (k.keys, k.key_types, k.types) == (first.keys, first.key_types, first.types)
                for k in kinds
            ):
                rows = _Rows(
                    [len(first.keys)] * len(kinds),
                    list(first.keys) * len(kinds),
                    first.key_nodes,
                    list(first.key_types) * len(kinds),
                    list(first.types) * len(kinds),
                    tuple(path for k in kinds for path in k.paths),
                )
        self.shapes[id(node)] = _MapShape(keys, key_types, key_nodes, types, kinds, paths, tensors, rows)

    def walk_sequence(self, value: list[Any] | tuple[Any, ...], path: str) -> dict[str, Any]:
        kind = "list" if type(value) is list else "tuple"
        if not self.noting:
            return {"t": kind, "items": [self.walk(item, join_path(path, i)) for i, item in enumerate(value)]}
        paths = _join_paths(path, range(len(value)))
        nodes = list(map(self.walk, value, paths))
        node = {"t": kind, "items": nodes}
        self.note_sequence(node, kind, value, nodes, paths)
        return node

    def note_sequence(
        self, node: dict[str, Any], kind: str, value: list[Any] | tuple[Any, ...], nodes: list[dict[str, Any]], paths: tuple[str, ...]
    ) -> None:
        kinds = tuple(map(self.kind, value, nodes))
        scalars = all(k is _SCALAR for k in kinds)
        tensors = all(k is _TENSOR for k in kinds)
        self.shapes[id(node)] = _SeqShape(kind, tuple(map(type, value)), kinds, None if scalars else paths, tensors)

    def kind(self, value: Any, node: dict[str, Any]) -> Any:
        """How ``value`` (walked into ``node``) is to be walked next time."""
        shape = self.shapes.get(id(node))
        if shape is not None:
            return shape
        if isinstance(value, torch.Tensor):
            return _WALK if type(value) not in _TENSOR_TYPES and is_dtensor(value) else _TENSOR
        if type(value) in _SCALAR_TYPES:
            return _SCALAR
        if type(value) in _ENCODE_TYPES:
            return _ENCODE
        return _WALK

    def module(self, module: nn.Module, path: str) -> dict[str, Any]:
        # keep_vars: the entries are the Parameters/buffers themselves, not detached aliases,
        # so spans hold the live objects and restore can write into them in place.
        entries = _call_state_dict(module, path, keep_vars=True)
        node = {"t": "module", "entries": self.guarded(entries, path, self.walk_mapping)}
        if self.noting:
            self.note_module(node, entries)
        return node

    def note_module(self, node: dict[str, Any], entries: Any) -> None:
        shape = self.shapes.get(id(node["entries"]))
        if shape is not None:
            self.shapes[id(node)] = _ModuleShape(type(entries), shape)  # type: ignore[arg-type]

    def stateful(self, obj: Any, path: str) -> dict[str, Any]:
        state = _call_state_dict(obj, path)
        node = {"t": "stateful", "cls": type_name(obj), "state": self.walk(state, path)}
        if self.noting:
            self.shapes[id(node)] = _StatefulShape(node["cls"], type(state), self.kind(state, node["state"]))
        return node

    def tensor(self, tensor: torch.Tensor, path: str) -> dict[str, Any]:
        seen = _supported.get(id(tensor))
        if seen is None or seen() is not tensor or _changed_kind(tensor):
            _check_supported(tensor, path)
        i = len(self.tensors)
        node: dict[str, Any] = self._ready[i] if i < len(self._ready) else {"t": "tensor"}  # as take() does
        self.tensors.append(tensor)
        self.paths.append(path)
        self.nodes.append(node)
        return node

    def dtensor(self, value: Any, path: str) -> dict[str, Any]:
        """Its layout (state/dtensor.py) and, where this rank is its primary holder, its local
        tensor as a leaf: a replica that is not primary stores nothing of it."""
        layout = layout_of(value)
        node = {k: v for k, v in layout.items() if k != "primary"}
        node["local"] = self.tensor(value._local_tensor, path) if layout["primary"] else None
        return node

    # -- the walk along the plan's shapes -----------------------------------------------------
    # Each replay* is entered only for a value of the exact type the shape was noted for (the
    # parent compared its items' types), and leaves the `supported` check of its tensors to
    # same_layouts.
    def replay_mapping(self, value: Mapping[Any, Any], shape: _MapShape, path: str) -> dict[str, Any]:
        keys = tuple(value)
        if keys != shape.keys or tuple(map(type, keys)) != shape.key_types:
            self.fallbacks += 1
            return self.walk_mapping(value, path)
        values = list(value.values())
        if tuple(map(type, values)) != shape.types:
            self.fallbacks += 1
            return self.walk_mapping(value, path)
        if shape.tensors:
            start = len(self.tensors)
            node = self.reuse(shape, values, shape.paths)  # type: ignore[assignment]
            if node is None:
                node = {"t": "dict", "items": list(zip(shape.key_nodes, self.take(values, shape.paths)))}
                self.made.append(((start, shape), node))
        elif shape.rows is not None and (tensors := self.rows_of(values, shape.rows)) is not None:
            start = len(self.tensors)
            node = self.reuse(shape, tensors, shape.rows.paths)  # type: ignore[assignment]
            if node is None:
                nodes = iter(self.take(tensors, shape.rows.paths))
                key_nodes = shape.rows.key_nodes
                rows = [{"t": "dict", "items": list(zip(key_nodes, row))} for row in zip(*[nodes] * len(key_nodes))]
                node = {"t": "dict", "items": list(zip(shape.key_nodes, rows))}
                self.made.append(((start, shape), node))
        else:
            fallbacks = self.fallbacks
            nodes = list(map(self.replay_item, values, shape.kinds, shape.paths))
            node = {"t": "dict", "items": list(zip(shape.key_nodes, nodes))}
            if self.fallbacks != fallbacks:  # an item walked otherwise: note the shape anew
                self.note_mapping(node, keys, values, shape.key_nodes, nodes, shape.paths)
                return node
        self.shapes[id(node)] = shape
        return node

    def rows_of(self, values: list[dict[Any, Any]], rows: _Rows) -> list[torch.Tensor] | None:
        """The tensors of ``values`` (dicts, by the parent's check), row after row, or None when
        some row differs. No cycle to check: a dict of tensors cannot hold its ancestors."""
        if list(map(len, values)) != rows.sizes:
            return None
        keys = list(chain.from_iterable(values))  # as many as rows.keys
        # the same key objects (an optimizer's str keys): of the same types too
        if not all(map(operator.is_, keys, rows.keys)) and (keys != rows.keys or list(map(type, keys)) != rows.key_types):
            return None
        tensors = list(chain.from_iterable(map(dict.values, values)))
        return tensors if list(map(type, tensors)) == rows.types else None

    def replay_sequence(self, value: list[Any] | tuple[Any, ...], shape: _SeqShape, path: str) -> dict[str, Any]:
        if tuple(map(type, value)) != shape.types:
            self.fallbacks += 1
            return self.walk_sequence(value, path)
        if shape.paths is None:  # scalars only (what encode_plain makes of them)
            made = self._made.get(shape)
            if made is not None and made[0] == value:  # (items of the same types: True == 1 ruled out)
                node = made[1]
            else:
                node = {"t": shape.kind, "items": [{"t": "v", "v": item} for item in value]}
                self.made.append((shape, (value[:], node)))  # a copy of a list
        elif shape.tensors:
            start = len(self.tensors)
            node = self.reuse(shape, list(value), shape.paths)  # type: ignore[assignment]
            if node is None:
                node = {"t": shape.kind, "items": self.take(list(value), shape.paths)}
                self.made.append(((start, shape), node))
        else:
            fallbacks = self.fallbacks
            nodes = list(map(self.replay_item, value, shape.kinds, shape.paths))
            node = {"t": shape.kind, "items": nodes}
            if self.fallbacks != fallbacks:
                self.note_sequence(node, shape.kind, value, nodes, shape.paths)
                return node
        self.shapes[id(node)] = shape
        return node

    def replay_item(self, value: Any, kind: Any, path: str) -> dict[str, Any]:
        if kind is _TENSOR:
            return self.take([value], (path,))[0]
        if kind is _SCALAR:
            return {"t": "v", "v": value}
        if kind is _ENCODE:
            return encode_plain(value, path, self.allow_pickle)
        if kind is _WALK:
            return self.walk(value, path)
        shape_type = type(kind)
        if shape_type is _ModuleShape:
            return self.replay_module(value, kind, path)
        if shape_type is _StatefulShape:
            return self.replay_stateful(value, kind, path)
        if type(value) is not dict and not isinstance(value, (list, tuple)) and is_stateful(value):
            self.fallbacks += 1  # an OrderedDict given state_dict/load_state_dict attributes
            return self.walk(value, path)
        self.enter(value, path)
        try:
            if shape_type is _MapShape:
                return self.replay_mapping(value, kind, path)
            return self.replay_sequence(value, kind, path)
        finally:
            self.active.discard(id(value))

    def replay_module(self, module: nn.Module, shape: _ModuleShape, path: str) -> dict[str, Any]:
        entries = _call_state_dict(module, path, keep_vars=True)
        self.enter(entries, path)
        try:
            if type(entries) is shape.entries_type:
                walked = self.replay_mapping(entries, shape.entries, path)
            else:
                self.fallbacks += 1
                walked = self.walk_mapping(entries, path)
        finally:
            self.active.discard(id(entries))
        node = {"t": "module", "entries": walked}
        if self.shapes.get(id(walked)) is shape.entries:
            self.shapes[id(node)] = shape
        else:
            self.note_module(node, entries)
        return node

    def replay_stateful(self, obj: Any, shape: _StatefulShape, path: str) -> dict[str, Any]:
        if not is_stateful(obj):  # lost its state_dict attribute
            self.fallbacks += 1
            return self.walk(obj, path)
        state = _call_state_dict(obj, path)
        if type(state) is shape.state_type:
            walked = self.replay_item(state, shape.state, path)
        else:
            self.fallbacks += 1
            walked = self.walk(state, path)
        node = {"t": "stateful", "cls": shape.cls, "state": walked}
        kind = self.kind(state, walked)
        self.shapes[id(node)] = shape if kind is shape.state else _StatefulShape(shape.cls, type(state), kind)
        return node

    def reuse(self, shape: _Shape, tensors: list[torch.Tensor], paths: tuple[str, ...]) -> dict[str, Any] | None:
        """The plan's node of a container of ``tensors`` only, when a walk made it at this leaf."""
        start = len(self.tensors)
        node = self._made.get((start, shape))
        if node is not None:
            self.tensors += tensors
            self.paths += paths
            self.nodes += self._ready[start : start + len(tensors)]
        return node

    def take(self, tensors: list[torch.Tensor], paths: tuple[str, ...]) -> list[dict[str, Any]]:
        """Tensor leaves met by replay*: their nodes are the plan's (same_layouts decides)."""
        i = len(self.tensors)
        self.tensors += tensors
        self.paths += paths
        nodes = self._ready[i : i + len(tensors)]
        if len(nodes) < len(tensors):  # more leaves than the plan has: it cannot match
            nodes += [{"t": "tensor"} for _ in range(len(tensors) - len(nodes))]
        self.nodes += nodes
        return nodes


def _join_paths(path: str, keys: Any) -> tuple[str, ...]:
    """``join_path(path, key)`` of each key (str or int), without a Python call per key."""
    return tuple(map(f"{path}/".__add__, map(str, keys))) if path else tuple(map(str, keys))


def _check_supported(tensor: torch.Tensor, path: str) -> None:
    """CheckpointError naming ``path`` when ``tensor`` cannot be stored."""
    seen = _supported.get(id(tensor))
    # a tensor object's kind does not change (`.data =` refuses other tensor types):
    # checked fully once; its device and lazy negation/conjugation (`.data =` accepts a
    # `_neg_view`, whose raw bytes are not its values) every time
    if seen is None or seen() is not tensor or _changed_kind(tensor):
        problem = tensor_problem(tensor)
        if problem is not None:
            raise CheckpointError(f"{path or '<root>'}: unsupported tensor: {problem}")
        if len(_supported) > 1 << 17:
            _supported.clear()  # dead entries of tensors long gone
        _supported[id(tensor)] = weakref.ref(tensor)


def _changed_kind(tensor: torch.Tensor) -> bool:
    """What ``.data =`` can change about a supported tensor object: its device, and lazy
    negation or conjugation bits."""
    return tensor.device.type not in _DEVICE_TYPES or tensor.is_neg() or tensor.is_conj()


def _swapped(node: dict[str, Any], new: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """``node`` with each node under it whose id is in ``new`` replaced by its new node: the
    node itself when nothing under it is, else a copy (every container on the way copied)."""
    swapped = new.get(id(node))
    if swapped is not None:
        return swapped
    kind = node.get("t")
    if kind == "dict":
        items = node["items"]
        pairs = [(key_node, _swapped(item, new)) for key_node, item in items]
        if all(a is b for (_, a), (_, b) in zip(items, pairs)):
            return node
        return {**node, "items": pairs}
    if kind in ("list", "tuple"):
        items = node["items"]
        nodes = [_swapped(item, new) for item in items]
        return node if all(map(operator.is_, items, nodes)) else {**node, "items": nodes}
    if kind in ("module", "stateful"):
        name = "entries" if kind == "module" else "state"
        inner = _swapped(node[name], new)
        return node if inner is node[name] else {**node, name: inner}
    if kind == "dtensor" and node.get("local") is not None:  # its local tensor is a leaf like any
        local = _swapped(node["local"], new)
        return node if local is node["local"] else {**node, "local": local}
    return node


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


# the per-leaf layout columns, read a whole list at a time (map over C getters)
_ATTRS = operator.attrgetter("shape", "dtype", "device", "requires_grad")
_CDATA = operator.attrgetter("_cdata")  # a storage's identity (its StorageImpl)
_deref = weakref.ref.__call__
_DEVICE_TYPES = ("cpu", "cuda")

# save() flattens every tensor of the state each time: per-tensor work is the caller's stall
_dtype_names: dict[torch.dtype, str] = {}
_supported: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> the tensor checked (by identity)
_device_names: dict[torch.device, str] = {}
_str_nodes: dict[str, dict[str, Any]] = {}
