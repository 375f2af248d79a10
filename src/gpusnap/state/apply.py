"""Plan a restore against the live ``app_state``: where every restored byte goes.

Call order::

    plan = plan_restore(app_state, manifest_tree, span_infos)   # checks everything, writes nothing
    plan.span_targets(i)          # the frozen targets of span i (restore/ copies into them:
    plan.byte_targets(i)          #   restore.apply_bytes, after plan.claim_span / claim_range)
    plan.finish()                 # before or after the spans: load_state_dict, plain values

The plan hands back typed, frozen targets (:class:`SpanTarget`, :class:`ByteTarget`) and keeps
the books of which bytes were claimed; moving bytes into them is ``restore``'s
(``restore/apply_bytes.py``: ``apply_span``, ``apply_range``, ``apply_ranges``).

``plan_restore`` pairs every checkpoint node with its target and raises one
RestoreMismatchError listing every key that does not fit before a single byte is written.
With ``strict=False`` keys on one side only are not mismatches: they are skipped and listed
(``plan.missing``: in app_state, not in the checkpoint; ``plan.unexpected``: the reverse), as
dotted paths naming the whole subtree the other side lacks (``optim``, ``model.extra_buf``).
Keys are compared where app_state's structure decides: the mappings of app_state (top level
and nested dicts holding tensors or objects; a dict of plain values only is one value) and
each module's ``state_dict()`` entries. Inside a Stateful value's
state_dict (an optimizer's, say) the checkpoint's structure wins, as with strict=True. Spans
that only skipped keys use are in ``plan.unused_spans``: the plan takes 0 bytes of them.
Shapes, dtypes and kinds of the keys on both sides are checked as with strict=True.
Tensors are filled bitwise (``restore.apply_bytes``), so every dtype and NaN payload survives.

Where the bytes land:

- ``nn.Module``: into its Parameters/buffers themselves (same objects, same data pointers).
  ``load_state_dict`` is *not* called for them: that would be a second full pass over the
  weights, and it would read tensors a lazy restore has not filled yet. It is called, with
  ``strict=False`` and only the other entries, when the module has extra state.
- Stateful values (optimizers, schedulers, RNGState, ...): their current ``state_dict()`` is the
  target. Its tensors of the right shape/dtype are filled in place; missing ones (optimizer
  state not created yet) are allocated here. ``finish()`` hands those very tensor objects to
  ``load_state_dict`` (optimizers keep them when dtype/device match, so data pointers stay).
- Tensors in the mapping or its dicts/lists: in place. Plain values: replaced in the mapping
  (nested dicts/lists are updated in place); tuples are rebuilt. A plain value never
  replaces a live tensor, module or Stateful (a mismatch).
- A checkpoint ``dict`` where app_state has a module or a Stateful is taken as its
  state_dict (what ``gpusnap import`` makes of other formats' files): restored as if the
  module or object itself had been saved.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, RestoreMismatchError
from .dtensor import is_dtensor
from .flatten import is_stateful, tensor_problem
from .nodes import is_plain_node, node_child, node_int, node_items, node_kind
from .plain import PLAIN_KINDS, decode_plain, dotted_path, dtype_from_name, join_path, type_name
from .plan import RestorePlan
from .reshard import ReshardPlanning
from .slots import DictSlot, ListSlot, ModuleSlot, Refill, Slot, StatefulSlot, TupleSlot, Value
from .targets import SpanInfo, SpanTarget, TensorSpec, allocate, target_problem

__all__ = ["Planner", "plan_restore"]

_QUANTIZED = frozenset(
    d for d in (getattr(torch, n, None) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")) if d is not None
)
_EXTRA_STATE_SUFFIX = "_extra_state"  # torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX


def plan_restore(
    app_state: MutableMapping[str, Any],
    tree: dict[str, Any],
    spans: Sequence[SpanInfo],
    *,
    allow_pickle: bool = False,
    strict: bool = True,
) -> RestorePlan:
    """Pair ``tree`` with ``app_state``; RestoreMismatchError (all problems at once) if it does not fit.

    Missing Stateful tensors are allocated here. Nothing in ``app_state`` changes until
    its spans are applied (``restore.apply_bytes``) / :meth:`RestorePlan.finish`. ``strict=False``: keys on one
    side only are skipped and reported instead (see the module docstring).
    """
    planner = Planner(spans, allow_pickle, strict=strict)
    root = planner.top(app_state, tree)
    if planner.modules_differ and planner.optimizers:
        # an optimizer's state is matched to its parameters by position: with a parameter
        # renamed, added or removed it would load another parameter's moments, silently
        planner.mismatches += [
            f"{opt}: an optimizer's state follows its parameters by position, and the parameters of "
            f"{', '.join(planner.modules_differ)} differ from the checkpoint's (see the missing and unexpected "
            "keys): leave the optimizer out of app_state (restore the model alone and make a fresh optimizer) "
            "or restore with strict=True"
            for opt in planner.optimizers
        ]
    if planner.mismatches:
        problems = "\n".join(f"  - {m}" for m in planner.mismatches)
        raise RestoreMismatchError(
            f"app_state does not fit the checkpoint ({len(planner.mismatches)} problem(s)); nothing was restored:\n"
            f"{problems}"
        )
    unused = frozenset() if strict else frozenset(range(len(spans))) - set(planner.copies)
    plan = RestorePlan(
        root,
        planner.copies,
        [0 if i in unused else s.nbytes for i, s in enumerate(spans)],
        planner.span_paths,
        planner.stateful_spans,
        planner.read_at_finish,
        missing=planner.missing,
        unexpected=planner.unexpected,
        unused_spans=unused,
        resharded=planner.resharded,
    )
    plan.sharded = planner.sharded
    return plan


class Planner(ReshardPlanning):
    """One walk over checkpoint tree and live state; collects copies and every mismatch."""

    def __init__(self, spans: Sequence[SpanInfo], allow_pickle: bool, *, strict: bool = True) -> None:
        self.spans = spans
        self.allow_pickle = allow_pickle
        self.strict = strict
        self.mismatches: list[str] = []
        self.missing: list[str] = []  # strict=False: dotted paths of keys only app_state has
        self.unexpected: list[str] = []  # ...and of keys only the checkpoint has
        self.modules_differ: list[str] = []  # strict=False: modules whose state_dict keys differ
        self.optimizers: list[str] = []  # optimizers in app_state that the checkpoint restores
        self.copies: dict[int, list[SpanTarget]] = {}
        self.span_paths: dict[int, list[str]] = {i: [] for i in range(len(spans))}
        self.stateful_spans: set[int] = set()
        self.read_at_finish: set[int] = set()
        self._targets: dict[int, tuple[int, int, str]] = {}  # id(target) -> (span, offset, path)
        self._stateful_depth = 0
        self._reader_depth = 0  # inside a load_state_dict that may read values unseen by the gate
        self.resharded: list[str] = []  # DTensors cut from another layout's pieces (state/reshard.py)
        self.sharded = False  # some target is a DTensor

    # -- structure -------------------------------------------------------------------------

    def top(self, app_state: MutableMapping[str, Any], tree: dict[str, Any]) -> Slot:
        if not isinstance(app_state, MutableMapping):
            raise CheckpointError(f"app_state must be a mutable mapping, got {type_name(app_state)}")
        if node_kind(tree, "") != "dict":
            raise CheckpointError("the checkpoint tree must be a 'dict' node at its root")
        pairs = self.keyed(tree, "")
        self.check_keys([k for k, _ in pairs], list(app_state), "", "app_state")
        items = [(key, self.owned(app_state[key], node, join_path("", key))) for key, node in pairs if key in app_state]
        return DictSlot(app_state, items)

    def keyed(self, node: dict[str, Any], path: str) -> list[tuple[Any, dict[str, Any]]]:
        """Decoded keys and value nodes of a ``dict`` node."""
        items = node.get("items")
        if not isinstance(items, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in items):
            raise CheckpointError(f"{path or '<root>'}: malformed 'dict' node")
        pairs = []
        for key_node, value_node in items:
            key = decode_plain(key_node, path, self.allow_pickle)
            try:
                hash(key)
            except TypeError:
                raise CheckpointError(f"{path or '<root>'}: unhashable dict key {key!r}") from None
            pairs.append((key, value_node))
        return pairs

    def check_keys(self, ckpt_keys: list[Any], live_keys: list[Any], path: str, what: str) -> None:
        live = set(live_keys)
        ckpt = set(ckpt_keys)
        missing = [k for k in live_keys if k not in ckpt]
        unexpected = [k for k in ckpt_keys if k not in live]
        if not self.strict:
            self.missing += [dotted_path(path, k) for k in missing]
            self.unexpected += [dotted_path(path, k) for k in unexpected]
            return
        where = path or "<root>"
        if missing:
            self.mismatches.append(f"{where}: keys in {what} but not in the checkpoint: {missing!r}")
        if unexpected:
            self.mismatches.append(f"{where}: keys in the checkpoint but not in {what}: {unexpected!r}")

    def owned(self, live: Any, node: dict[str, Any], path: str) -> Slot:
        """``live`` belongs to app_state: tensors are filled in place, containers updated in place."""
        kind = node_kind(node, path)
        if kind == "tensor":
            return self.tensor_in_place(live, node, path)
        if kind == "dtensor":
            return self.dtensor_target(live, node, path, allocate=False)
        if kind in ("module", "stateful"):
            return self.object(live, node, path)
        if kind == "dict" and isinstance(live, nn.Module):
            # a state_dict stored as a plain dict (``gpusnap import``, a dict of a module's
            # tensors saved by hand) restores as that module's entries would
            return self.module(live, {"t": "module", "entries": node}, path)
        if kind == "dict" and is_stateful(live) and not isinstance(live, Mapping):
            return self.object(live, {"t": "stateful", "cls": type_name(live), "state": node}, path)
        if kind in PLAIN_KINDS and is_plain_node(node):
            held = _live_object(live)
            if held is not None:  # replacing it would drop the program's tensors silently
                return self.mismatch(path, f"the checkpoint has a plain value ({kind!r} node), app_state has {held}")
            return self.plain(node, path, live)
        if kind == "dict":
            return self.owned_dict(live, node, path)
        if kind in ("list", "tuple"):
            return self.owned_sequence(live, node, path, kind)
        raise CheckpointError(f"{path or '<root>'}: unknown checkpoint node kind {kind!r}")

    def owned_dict(self, live: Any, node: dict[str, Any], path: str) -> Slot:
        pairs = self.keyed(node, path)
        if not isinstance(live, MutableMapping):
            return self.mismatch(path, f"the checkpoint has a dict, app_state has a {type_name(live)}")
        self.check_keys([k for k, _ in pairs], list(live), path, "app_state")
        return DictSlot(live, [(k, self.owned(live[k], n, join_path(path, k))) for k, n in pairs if k in live])

    def owned_sequence(self, live: Any, node: dict[str, Any], path: str, kind: str) -> Slot:
        items = node_items(node, path)
        expected = list if kind == "list" else tuple
        if not isinstance(live, expected):
            return self.mismatch(path, f"the checkpoint has a {kind}, app_state has a {type_name(live)}")
        if len(live) != len(items):
            return self.mismatch(path, f"the checkpoint has a {kind} of length {len(items)}, app_state {len(live)}")
        slots = [self.owned(v, n, join_path(path, i)) for i, (v, n) in enumerate(zip(live, items))]
        return ListSlot(live, slots) if kind == "list" else TupleSlot(live, slots)

    def in_state(self, current: Any, node: dict[str, Any], path: str) -> Slot:
        """Inside a state_dict: the checkpoint's structure wins; ``current`` only lends tensors."""
        kind = node_kind(node, path)
        if kind == "tensor":
            return self.tensor_in_state(current, node, path)
        if kind == "dtensor":
            return self.dtensor_target(current, node, path, allocate=True)
        if kind in ("module", "stateful"):
            return self.object(current, node, path)
        if kind in PLAIN_KINDS and is_plain_node(node):
            return self.plain(node, path, None)
        if kind == "dict":
            lender = current if isinstance(current, Mapping) else {}
            pairs = self.keyed(node, path)
            return DictSlot(None, [(k, self.in_state(lender.get(k), n, join_path(path, k))) for k, n in pairs])
        if kind in ("list", "tuple"):
            items = node_items(node, path)
            lender = list(current) if isinstance(current, (list, tuple)) else []
            lender += [None] * (len(items) - len(lender))
            slots = [self.in_state(lender[i], n, join_path(path, i)) for i, n in enumerate(items)]
            return ListSlot(None, slots) if kind == "list" else TupleSlot(None, slots)
        raise CheckpointError(f"{path or '<root>'}: unknown checkpoint node kind {kind!r}")

    def plain(self, node: dict[str, Any], path: str, live: Any) -> Slot:
        value = decode_plain(node, path, self.allow_pickle)  # decoded now: a refusal must come first
        if isinstance(value, dict) and isinstance(live, MutableMapping) or (
            isinstance(value, list) and isinstance(live, list)
        ):
            return Refill(live, value)
        return Value(value)

    def mismatch(self, path: str, message: str) -> Slot:
        self.mismatches.append(f"{path or '<root>'}: {message}")
        return Value(None)

    # -- objects ---------------------------------------------------------------------------

    def object(self, live: Any, node: dict[str, Any], path: str) -> Slot:
        if node["t"] == "module":
            if not isinstance(live, nn.Module):
                return self.mismatch(path, f"the checkpoint has an nn.Module, app_state has a {type_name(live)}")
            return self.module(live, node, path)
        if not is_stateful(live):
            return self.mismatch(
                path, f"the checkpoint has a Stateful ({node.get('cls')}), app_state has a {type_name(live)}"
            )
        current = _state_dict(live, path)
        reader = not isinstance(live, torch.optim.Optimizer)
        if not reader:
            self.optimizers.append(path or "<root>")
        self._stateful_depth += 1
        self._reader_depth += reader
        try:
            state = self.in_state(current, node_child(node, "state", path), path)
        finally:
            self._stateful_depth -= 1
            self._reader_depth -= reader
        return StatefulSlot(live, path, state)

    def module(self, module: nn.Module, node: dict[str, Any], path: str) -> Slot:
        entries = node_child(node, "entries", path)
        if node_kind(entries, path) != "dict":
            raise CheckpointError(f"{path or '<root>'}: a module's entries must be a 'dict' node")
        pairs = self.keyed(entries, path)
        current = _state_dict(module, path, keep_vars=True)
        if not self.strict and {k for k, _ in pairs} != set(current):
            self.modules_differ.append(path or "<root>")
        self.check_keys([k for k, _ in pairs], list(current), path, "the module")
        own = {id(t) for _, t in module.named_parameters(remove_duplicate=False)}
        own |= {id(t) for _, t in module.named_buffers(remove_duplicate=False)}
        extra: list[tuple[str, Slot]] = []
        for key, entry in pairs:
            if key not in current:
                continue
            live, entry_path = current[key], join_path(path, key)
            if node_kind(entry, entry_path) == "tensor" and id(live) in own:
                self.tensor_in_place(live, entry, entry_path)
            elif node_kind(entry, entry_path) == "dtensor" and id(live) in own:
                self.dtensor_target(live, entry, entry_path, allocate=False)
            elif node_kind(entry, entry_path) in ("tensor", "dtensor") and not isinstance(live, torch.Tensor):
                self.mismatch(entry_path, f"the checkpoint has a tensor, the module has a {type_name(live)}")
            else:  # extra state, or a tensor _save_to_state_dict computed: only load_state_dict can take it
                self._reader_depth += 1
                try:
                    extra.append((key, self.in_state(live, entry, entry_path)))
                finally:
                    self._reader_depth -= 1
        return ModuleSlot(module, path, extra, getattr(current, "_metadata", None))

    # -- tensors ---------------------------------------------------------------------------

    def tensor_in_place(self, live: Any, node: dict[str, Any], path: str) -> Slot:
        spec = self.spec(node, path)
        if not isinstance(live, torch.Tensor):
            found = type_name(live)
            return self.mismatch(path, f"the checkpoint has a tensor ({spec.describe()}), app_state has a {found}")
        if is_dtensor(live):  # a tensor saved whole, into a sharded target
            return self.tensor_into_dtensor(live, spec, path)
        problem = target_problem(live, spec)
        if problem is not None:
            return self.mismatch(path, problem)
        self.add_copy(live, spec, path)
        return Value(live)

    def tensor_in_state(self, current: Any, node: dict[str, Any], path: str) -> Slot:
        spec = self.spec(node, path)
        if is_dtensor(current):
            return self.tensor_into_dtensor(current, spec, path)
        if isinstance(current, torch.Tensor) and tensor_problem(current) is None:
            problem = target_problem(current, spec)
            if problem is not None:
                return self.mismatch(path, problem)
            target = current
        else:  # not created yet (fresh optimizer), or nothing usable to write into
            target = allocate(spec)
        self.add_copy(target, spec, path)
        return Value(target)

    def add_copy(self, target: torch.Tensor, spec: TensorSpec, path: str) -> None:
        self.span_paths[spec.storage].append(path)
        if self._stateful_depth:
            self.stateful_spans.add(spec.storage)
        if self._reader_depth:
            self.read_at_finish.add(spec.storage)
        seen = self._targets.get(id(target))
        if seen is not None:
            if seen[:2] != (spec.storage, spec.byte_offset):
                self.mismatch(path, f"this tensor is also {seen[2]} here, but the checkpoint stores them apart")
            return  # tied: one tensor, one copy
        self._targets[id(target)] = (spec.storage, spec.byte_offset, path)
        self.copies.setdefault(spec.storage, []).append(SpanTarget(target, spec, path))

    def add_box_copy(self, target: torch.Tensor, spec: TensorSpec, src: tuple[slice, ...], dst: tuple[slice, ...],
                     path: str) -> None:
        """A box copy: ``target[dst] = stored[src]`` (one of several into one target)."""
        self.span_paths[spec.storage].append(path)
        if self._stateful_depth:
            self.stateful_spans.add(spec.storage)
        if self._reader_depth:
            self.read_at_finish.add(spec.storage)
        self.copies.setdefault(spec.storage, []).append(SpanTarget(target, spec, path, src, dst))

    def spec(self, node: dict[str, Any], path: str) -> TensorSpec:
        where = path or "<root>"
        try:
            spec = TensorSpec(
                storage=node_int(node["storage"]),
                dtype=dtype_from_name(node["dtype"], path),
                shape=tuple(node_int(d) for d in node["shape"]),
                stride=tuple(node_int(s) for s in node["stride"]),
                byte_offset=node_int(node["byte_offset"]),
                device=str(node["device"]),
                requires_grad=bool(node["requires_grad"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: malformed 'tensor' node: {exc!r}") from exc
        if spec.dtype in _QUANTIZED:
            raise CheckpointError(f"{where}: quantized dtype {spec.dtype} cannot be restored")
        if len(spec.shape) != len(spec.stride) or min(spec.shape + spec.stride + (spec.byte_offset,), default=0) < 0:
            raise CheckpointError(f"{where}: malformed 'tensor' node: shape {spec.shape}, stride {spec.stride}")
        if not 0 <= spec.storage < len(self.spans):
            raise CheckpointError(f"{where}: storage {spec.storage} is not in the checkpoint's storage table")
        if spec.numel and spec.byte_offset + spec.extent > self.spans[spec.storage].nbytes:
            raise CheckpointError(
                f"{where}: the tensor reaches byte {spec.byte_offset + spec.extent} of storage {spec.storage}, "
                f"which holds {self.spans[spec.storage].nbytes}; the checkpoint is inconsistent"
            )
        return spec



def _live_object(live: Any, seen: frozenset[int] = frozenset()) -> str | None:
    """What in ``live`` a plain value must not replace (a tensor, module or Stateful object,
    also inside a dict, list or tuple), described for the error; None when it is plain."""
    if isinstance(live, (torch.Tensor, nn.Module)) or (is_stateful(live) and not isinstance(live, Mapping)):
        return f"a {type_name(live)}"
    if isinstance(live, (Mapping, list, tuple)) and id(live) not in seen:  # (a live cycle is walked once)
        items = live.values() if isinstance(live, Mapping) else live
        if any(_live_object(item, seen | {id(live)}) is not None for item in items):
            return f"a {type_name(live)} holding tensors or objects"
    return None


def _state_dict(obj: Any, path: str, **kwargs: Any) -> Any:
    try:
        return obj.state_dict(**kwargs)
    except Exception as exc:
        raise CheckpointError(f"{path or '<root>'}: {type_name(obj)}.state_dict() failed: {exc!r}") from exc

