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

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, MutableMapping, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ..errors import CheckpointError, RestoreMismatchError
from .dtensor import is_dtensor
from .flatten import is_stateful, tensor_problem
from .reshard import ReshardPlanning
from .plain import (
    PLAIN_KINDS,
    decode_plain,
    dotted_path,
    dtype_from_name,
    dtype_name,
    join_path,
    type_name,
)

__all__ = ["ByteTarget", "RestorePlan", "SpanInfo", "SpanTarget", "TensorSpec", "plan_restore"]

_QUANTIZED = frozenset(
    d for d in (getattr(torch, n, None) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")) if d is not None
)
_EXTRA_STATE_SUFFIX = "_extra_state"  # torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX


@dataclass(frozen=True)
class SpanInfo:
    """What the manifest says about one stored span: its length and the device it came from."""

    nbytes: int
    device: str


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
    planner = _Planner(spans, allow_pickle, strict=strict)
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


@dataclass(frozen=True)
class TensorSpec:
    """A checked ``tensor`` node: where a tensor's bytes lie in its stored span."""

    storage: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    byte_offset: int
    device: str
    requires_grad: bool

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def extent(self) -> int:
        """Bytes from the first to past the last element (0 when empty)."""
        if self.numel == 0:
            return 0
        return (sum((n - 1) * s for n, s in zip(self.shape, self.stride)) + 1) * self.itemsize

    def describe(self) -> str:
        return f"shape {list(self.shape)} dtype {dtype_name(self.dtype)}"


@dataclass(frozen=True)
class SpanTarget:
    """Fill ``target`` from the bytes of span ``spec.storage``; a *box copy* (resharding,
    state/reshard.py) fills ``target[dst]`` from ``stored[src]`` only (it needs the whole span)."""

    target: torch.Tensor
    spec: TensorSpec
    path: str
    src: tuple[slice, ...] | None = None
    dst: tuple[slice, ...] | None = None

    def writable(self, versioned: bool) -> torch.Tensor:
        """``target``'s memory, through an alias that shares its autograd version counter
        (``detach``) or not (``.data``: the write is invisible to autograd's in-place checks)."""
        return self.target.detach() if versioned else self.target.data


@dataclass(frozen=True, slots=True)
class ByteTarget:
    """A target of a :meth:`RestorePlan.streamable` span: bytes ``[start, stop)`` of the span
    are ``dst`` (a flat ``uint8`` alias of the target's memory); ``inference``: the target is
    an inference tensor (written under inference mode); ``path`` names it for errors."""

    start: int
    stop: int
    dst: torch.Tensor
    inference: bool
    path: str


class _Slot(Protocol):
    """A paired node; ``build()`` (at finish) applies side effects and returns the restored value."""

    def build(self) -> Any: ...


@dataclass
class _Value:
    value: Any

    def build(self) -> Any:
        return self.value


@dataclass
class _Refill:
    """A live dict/list of plain values: its contents become ``value``, its identity stays."""

    live: Any
    value: Any

    def build(self) -> Any:
        if isinstance(self.live, MutableMapping):
            self.live.clear()
            self.live.update(self.value)
        else:
            self.live[:] = self.value
        return self.live


@dataclass
class _Dict:
    """``live`` is updated in place when given (app_state), else a new dict is built."""

    live: MutableMapping[Any, Any] | None
    items: list[tuple[Any, _Slot]]

    def build(self) -> Any:
        if self.live is None:
            return {key: slot.build() for key, slot in self.items}
        for key, slot in self.items:
            value = slot.build()
            if self.live[key] is not value:
                self.live[key] = value
        return self.live


@dataclass
class _List:
    live: MutableSequence[Any] | None
    items: list[_Slot]

    def build(self) -> Any:
        if self.live is None:
            return [slot.build() for slot in self.items]
        for i, slot in enumerate(self.items):
            value = slot.build()
            if self.live[i] is not value:
                self.live[i] = value
        return self.live


@dataclass
class _Tuple:
    live: tuple[Any, ...] | None
    items: list[_Slot]

    def build(self) -> Any:
        values = tuple(slot.build() for slot in self.items)
        live = self.live
        if live is not None and len(live) == len(values) and all(a is b for a, b in zip(live, values)):
            return live
        return values


@dataclass
class _Module:
    module: nn.Module
    path: str
    extra: list[tuple[str, _Slot]]
    metadata: Any

    def build(self) -> Any:
        if self.extra:
            state: OrderedDict[str, Any] = OrderedDict((key, slot.build()) for key, slot in self.extra)
            if self.metadata is not None:
                state._metadata = self.metadata  # type: ignore[attr-defined]  # version info for _load_from_state_dict
            # strict=False: the tensors are absent on purpose, they were restored in place.
            _load(self.module, state, self.path, strict=False)
        return self.module


@dataclass
class _Stateful:
    obj: Any
    path: str
    state: _Slot

    def build(self) -> Any:
        _load(self.obj, self.state.build(), self.path)
        return self.obj


def _load(obj: Any, state: Any, path: str, **kwargs: Any) -> None:
    try:
        obj.load_state_dict(state, **kwargs)
    except Exception as exc:
        raise CheckpointError(f"{path or '<root>'}: {type_name(obj)}.load_state_dict() failed: {exc!r}") from exc


class RestorePlan:
    """Targets paired with checkpoint spans; see the module docstring for the call order.

    ``span_paths`` names the key paths filled from each span (for error messages).
    ``stateful_spans`` are the spans whose tensors are handed to a Stateful's ``load_state_dict``.
    ``read_at_finish`` is the subset a lazy restore must load before :meth:`finish`: spans whose
    values ``load_state_dict`` may read without an ATen op a dispatch mode would see (RNGState
    does; a module's extra state may). Optimizers are left out: their ``load_state_dict`` only
    keeps the tensor objects, or converts them with ``Tensor.to``, which the lazy gate sees.
    ``missing``, ``unexpected`` and ``unused_spans``: what a ``strict=False`` plan skipped
    (empty otherwise); an unused span is applied as 0 bytes, so a reader reads none of it.
    ``resharded``: DTensors cut from pieces of another layout (box copies: a target may be
    filled from several spans, so such a restore is eager).
    """

    def __init__(
        self,
        root: _Slot,
        copies: dict[int, list[SpanTarget]],
        span_nbytes: list[int],
        span_paths: dict[int, list[str]],
        stateful_spans: set[int],
        read_at_finish: set[int] | None = None,
        *,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        unused_spans: frozenset[int] = frozenset(),
        resharded: Sequence[str] = (),
    ) -> None:
        self.span_paths = span_paths
        self.resharded = tuple(resharded)
        self.sharded = bool(resharded)  # some target is a DTensor (set by plan_restore)
        self.missing = tuple(missing)
        self.unexpected = tuple(unexpected)
        self.unused_spans = unused_spans
        self.stateful_spans = frozenset(stateful_spans)
        self.read_at_finish = frozenset(stateful_spans if read_at_finish is None else read_at_finish)
        self._root = root
        self._copies = copies
        self._span_nbytes = span_nbytes
        self._lock = threading.Lock()
        self._applied: set[int] = set()
        self._filled: dict[int, int] = {}  # bytes claimed by claim_range so far, per span
        self._streamable: dict[int, bool] = {}
        self._byte_views: dict[int, tuple[bool, tuple[ByteTarget, ...]]] = {}
        self._finished = False
        # Whether the restore's writes advance the targets' autograd version counters. A lazy
        # restore turns this off: autograd records an op's inputs (and their versions) above
        # the gate, before the op waits there for their bytes, so the restore's own writes
        # would read as in-place changes in backward (LazyRestore sets it; see docs/restore.md).
        self.versioned_writes = True

    @property
    def pending_spans(self) -> frozenset[int]:
        """Span indices not applied yet."""
        with self._lock:
            return frozenset(range(len(self._span_nbytes))) - self._applied

    def span_targets(self, index: int) -> tuple[SpanTarget, ...]:
        """What span ``index`` fills: each target with where its bytes lie in the span."""
        return tuple(self._copies.get(index, ()))

    def targets(self, index: int) -> list[torch.Tensor]:
        """The live tensors span ``index`` fills (a lazy restore gates the program on them)."""
        return [copy.target for copy in self._copies.get(index, ())]

    def devices(self, index: int) -> set[torch.device]:
        """Devices of the tensors span ``index`` fills."""
        return {copy.target.device for copy in self._copies.get(index, ())}

    def streamable(self, index: int) -> bool:
        """Whether span ``index`` may be applied piecewise (``restore.apply_bytes.apply_range``).

        True when every target's bytes are one run of the span's bytes in the same order:
        the checkpoint's layout and the target are both row-major contiguous. Transposed,
        strided or overlapping layouts need the whole span (``apply_span``).
        """
        known = self._streamable.get(index)
        if known is None:
            known = self._streamable[index] = all(
                copy.src is None and _byte_contiguous(copy.target, copy.spec) for copy in self._copies.get(index, ())
            )
        return known

    def prepare_byte_views(self, indices: Iterable[int]) -> None:
        """Build the cached aliases of these spans' targets now (see :meth:`byte_targets`).

        The loader calls this on the restoring thread before its readers start: built later,
        on the copy thread, each of the few torch calls per target waits for the GIL against
        the readers, and this work took ~30% of a GPT-2 large restore (BENCHMARKS.md)."""
        for index in indices:
            self.byte_targets(index)

    def forget_byte_views(self) -> None:
        """Drop the cached aliases of the targets (the loader calls this when it stops): they
        would keep storages alive that the program swaps out later (``param.data = ...``)."""
        self._byte_views = {}

    def byte_targets(self, index: int) -> tuple[ByteTarget, ...]:
        """Per target of a :meth:`streamable` span: its byte range in the span and its bytes as
        a flat uint8 alias (:class:`ByteTarget`), where a restore's copies (or the restore
        server, over CUDA IPC) put them. Built once per span and write mode: a restore
        applies a large model's spans in thousands of ranges, on the one thread that bounds
        its rate."""
        cached = self._byte_views.get(index)
        if cached is not None and cached[0] == self.versioned_writes:
            return cached[1]
        views = []
        # Outside inference mode whoever builds them (the restoring thread, which may be in
        # it): a view made inside it is an inference tensor, which the copy thread and the
        # readers could not write. Inference-tensor targets are written under the mode anyway.
        with torch.inference_mode(False):
            for copy in self._copies.get(index, ()):
                spec = copy.spec
                if spec.numel == 0:
                    continue
                dst = copy.writable(self.versioned_writes).view(-1).view(torch.uint8)  # contiguous: views
                views.append(ByteTarget(spec.byte_offset, spec.byte_offset + spec.extent, dst,
                                        copy.target.is_inference(), copy.path))
        frozen = tuple(views)
        self._byte_views[index] = (self.versioned_writes, frozen)
        return frozen

    def finish(self) -> None:
        """Call ``load_state_dict`` on Stateful values and put plain values back; once."""
        with self._lock:
            if self._finished:
                raise CheckpointError("RestorePlan.finish() was already called")
            self._finished = True
        self._root.build()

    def claim_span(self, index: int, data: torch.Tensor) -> None:
        """Count span ``index`` as applied whole from ``data`` (checked: a contiguous 1-D uint8
        tensor of the span's length); CheckpointError if it cannot be, or already was."""
        if not 0 <= index < len(self._span_nbytes):
            raise CheckpointError(f"span {index} does not exist (the checkpoint has {len(self._span_nbytes)})")
        nbytes = self._span_nbytes[index]
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != nbytes or data.stride(0) != 1:
            raise CheckpointError(
                f"span {index}: expected a contiguous 1-D uint8 tensor of {nbytes} bytes, got "
                f"{data.dtype} of shape {list(data.shape)}"
            )
        with self._lock:
            if index in self._applied or index in self._filled:
                raise CheckpointError(f"span {index} was already applied")
            self._applied.add(index)

    def claim_range(self, index: int, offset: int, data: torch.Tensor) -> None:
        """Count ``data``'s bytes at ``offset`` of span ``index`` as applied (ranges of a
        :meth:`streamable` span, any order, from several threads; the span counts as applied
        once they cover it); CheckpointError for a range outside it, or too many bytes."""
        if not 0 <= index < len(self._span_nbytes):
            raise CheckpointError(f"span {index} does not exist (the checkpoint has {len(self._span_nbytes)})")
        nbytes = self._span_nbytes[index]
        if data.dtype != torch.uint8 or data.dim() != 1 or data.stride(0) != 1:
            raise CheckpointError(f"span {index}: expected a contiguous 1-D uint8 tensor, got {data.dtype}")
        if offset < 0 or offset + data.numel() > nbytes:
            raise CheckpointError(f"span {index}: bytes [{offset}, {offset + data.numel()}) lie outside its {nbytes}")
        if not self.streamable(index):
            raise CheckpointError(f"span {index} has targets that need the whole span: use apply_span")
        with self._lock:
            if index in self._applied:
                raise CheckpointError(f"span {index} was already applied")
            filled = self._filled.get(index, 0) + data.numel()
            if filled > nbytes:
                raise CheckpointError(f"span {index}: more bytes applied than it holds ({filled} > {nbytes})")
            self._filled[index] = filled
            if filled == nbytes:
                self._applied.add(index)


class _Planner(ReshardPlanning):
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

    def top(self, app_state: MutableMapping[str, Any], tree: dict[str, Any]) -> _Slot:
        if not isinstance(app_state, MutableMapping):
            raise CheckpointError(f"app_state must be a mutable mapping, got {type_name(app_state)}")
        if _kind(tree, "") != "dict":
            raise CheckpointError("the checkpoint tree must be a 'dict' node at its root")
        pairs = self.keyed(tree, "")
        self.check_keys([k for k, _ in pairs], list(app_state), "", "app_state")
        items = [(key, self.owned(app_state[key], node, join_path("", key))) for key, node in pairs if key in app_state]
        return _Dict(app_state, items)

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

    def owned(self, live: Any, node: dict[str, Any], path: str) -> _Slot:
        """``live`` belongs to app_state: tensors are filled in place, containers updated in place."""
        kind = _kind(node, path)
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
        if kind in PLAIN_KINDS and _is_plain_node(node):
            held = _live_object(live)
            if held is not None:  # replacing it would drop the program's tensors silently
                return self.mismatch(path, f"the checkpoint has a plain value ({kind!r} node), app_state has {held}")
            return self.plain(node, path, live)
        if kind == "dict":
            return self.owned_dict(live, node, path)
        if kind in ("list", "tuple"):
            return self.owned_sequence(live, node, path, kind)
        raise CheckpointError(f"{path or '<root>'}: unknown checkpoint node kind {kind!r}")

    def owned_dict(self, live: Any, node: dict[str, Any], path: str) -> _Slot:
        pairs = self.keyed(node, path)
        if not isinstance(live, MutableMapping):
            return self.mismatch(path, f"the checkpoint has a dict, app_state has a {type_name(live)}")
        self.check_keys([k for k, _ in pairs], list(live), path, "app_state")
        return _Dict(live, [(k, self.owned(live[k], n, join_path(path, k))) for k, n in pairs if k in live])

    def owned_sequence(self, live: Any, node: dict[str, Any], path: str, kind: str) -> _Slot:
        items = _items(node, path)
        expected = list if kind == "list" else tuple
        if not isinstance(live, expected):
            return self.mismatch(path, f"the checkpoint has a {kind}, app_state has a {type_name(live)}")
        if len(live) != len(items):
            return self.mismatch(path, f"the checkpoint has a {kind} of length {len(items)}, app_state {len(live)}")
        slots = [self.owned(v, n, join_path(path, i)) for i, (v, n) in enumerate(zip(live, items))]
        return _List(live, slots) if kind == "list" else _Tuple(live, slots)

    def in_state(self, current: Any, node: dict[str, Any], path: str) -> _Slot:
        """Inside a state_dict: the checkpoint's structure wins; ``current`` only lends tensors."""
        kind = _kind(node, path)
        if kind == "tensor":
            return self.tensor_in_state(current, node, path)
        if kind == "dtensor":
            return self.dtensor_target(current, node, path, allocate=True)
        if kind in ("module", "stateful"):
            return self.object(current, node, path)
        if kind in PLAIN_KINDS and _is_plain_node(node):
            return self.plain(node, path, None)
        if kind == "dict":
            lender = current if isinstance(current, Mapping) else {}
            pairs = self.keyed(node, path)
            return _Dict(None, [(k, self.in_state(lender.get(k), n, join_path(path, k))) for k, n in pairs])
        if kind in ("list", "tuple"):
            items = _items(node, path)
            lender = list(current) if isinstance(current, (list, tuple)) else []
            lender += [None] * (len(items) - len(lender))
            slots = [self.in_state(lender[i], n, join_path(path, i)) for i, n in enumerate(items)]
            return _List(None, slots) if kind == "list" else _Tuple(None, slots)
        raise CheckpointError(f"{path or '<root>'}: unknown checkpoint node kind {kind!r}")

    def plain(self, node: dict[str, Any], path: str, live: Any) -> _Slot:
        value = decode_plain(node, path, self.allow_pickle)  # decoded now: a refusal must come first
        if isinstance(value, dict) and isinstance(live, MutableMapping) or (
            isinstance(value, list) and isinstance(live, list)
        ):
            return _Refill(live, value)
        return _Value(value)

    def mismatch(self, path: str, message: str) -> _Slot:
        self.mismatches.append(f"{path or '<root>'}: {message}")
        return _Value(None)

    # -- objects ---------------------------------------------------------------------------

    def object(self, live: Any, node: dict[str, Any], path: str) -> _Slot:
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
            state = self.in_state(current, _child(node, "state", path), path)
        finally:
            self._stateful_depth -= 1
            self._reader_depth -= reader
        return _Stateful(live, path, state)

    def module(self, module: nn.Module, node: dict[str, Any], path: str) -> _Slot:
        entries = _child(node, "entries", path)
        if _kind(entries, path) != "dict":
            raise CheckpointError(f"{path or '<root>'}: a module's entries must be a 'dict' node")
        pairs = self.keyed(entries, path)
        current = _state_dict(module, path, keep_vars=True)
        if not self.strict and {k for k, _ in pairs} != set(current):
            self.modules_differ.append(path or "<root>")
        self.check_keys([k for k, _ in pairs], list(current), path, "the module")
        own = {id(t) for _, t in module.named_parameters(remove_duplicate=False)}
        own |= {id(t) for _, t in module.named_buffers(remove_duplicate=False)}
        extra: list[tuple[str, _Slot]] = []
        for key, entry in pairs:
            if key not in current:
                continue
            live, entry_path = current[key], join_path(path, key)
            if _kind(entry, entry_path) == "tensor" and id(live) in own:
                self.tensor_in_place(live, entry, entry_path)
            elif _kind(entry, entry_path) == "dtensor" and id(live) in own:
                self.dtensor_target(live, entry, entry_path, allocate=False)
            elif _kind(entry, entry_path) in ("tensor", "dtensor") and not isinstance(live, torch.Tensor):
                self.mismatch(entry_path, f"the checkpoint has a tensor, the module has a {type_name(live)}")
            else:  # extra state, or a tensor _save_to_state_dict computed: only load_state_dict can take it
                self._reader_depth += 1
                try:
                    extra.append((key, self.in_state(live, entry, entry_path)))
                finally:
                    self._reader_depth -= 1
        return _Module(module, path, extra, getattr(current, "_metadata", None))

    # -- tensors ---------------------------------------------------------------------------

    def tensor_in_place(self, live: Any, node: dict[str, Any], path: str) -> _Slot:
        spec = self.spec(node, path)
        if not isinstance(live, torch.Tensor):
            found = type_name(live)
            return self.mismatch(path, f"the checkpoint has a tensor ({spec.describe()}), app_state has a {found}")
        if is_dtensor(live):  # a tensor saved whole, into a sharded target
            return self.tensor_into_dtensor(live, spec, path)
        problem = _target_problem(live, spec)
        if problem is not None:
            return self.mismatch(path, problem)
        self.add_copy(live, spec, path)
        return _Value(live)

    def tensor_in_state(self, current: Any, node: dict[str, Any], path: str) -> _Slot:
        spec = self.spec(node, path)
        if is_dtensor(current):
            return self.tensor_into_dtensor(current, spec, path)
        if isinstance(current, torch.Tensor) and tensor_problem(current) is None:
            problem = _target_problem(current, spec)
            if problem is not None:
                return self.mismatch(path, problem)
            target = current
        else:  # not created yet (fresh optimizer), or nothing usable to write into
            target = _allocate(spec)
        self.add_copy(target, spec, path)
        return _Value(target)

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
                storage=_int(node["storage"]),
                dtype=dtype_from_name(node["dtype"], path),
                shape=tuple(_int(d) for d in node["shape"]),
                stride=tuple(_int(s) for s in node["stride"]),
                byte_offset=_int(node["byte_offset"]),
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


def _kind(node: Any, path: str) -> str:
    kind = node.get("t") if isinstance(node, dict) else None
    if not isinstance(kind, str):
        raise CheckpointError(f"{path or '<root>'}: malformed checkpoint node {str(node)[:80]!r}")
    return kind


def _child(node: dict[str, Any], field: str, path: str) -> dict[str, Any]:
    child = node.get(field)
    if not isinstance(child, dict):
        raise CheckpointError(f"{path or '<root>'}: a {node['t']!r} node has no {field!r}")
    return child


def _items(node: dict[str, Any], path: str) -> list[Any]:
    items = node.get("items")
    if not isinstance(items, list):
        raise CheckpointError(f"{path or '<root>'}: malformed {node['t']!r} node")
    return items


def _int(value: Any) -> int:
    if type(value) is not int:
        raise TypeError(f"expected an int, got {value!r}")
    return value


def _is_plain_node(node: Any) -> bool:
    """True when the subtree holds no tensor or object: it is restored as one value.

    Malformed parts count as plain so that :func:`decode_plain` reports them.
    """
    if not isinstance(node, dict):
        return True
    kind, items = node.get("t"), node.get("items")
    if kind in ("dict", "list", "tuple") and isinstance(items, list):
        if kind == "dict":
            items = [p[1] for p in items if isinstance(p, (list, tuple)) and len(p) == 2]
        return all(_is_plain_node(v) for v in items)
    return kind in PLAIN_KINDS


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


def _target_problem(target: torch.Tensor, spec: TensorSpec) -> str | None:
    """Why ``target`` cannot take the checkpoint's tensor in place, or None."""
    if target.shape != spec.shape or target.dtype != spec.dtype:
        return (
            f"the checkpoint has {spec.describe()}, the target has "
            f"shape {list(target.shape)} dtype {dtype_name(target.dtype)}"
        )
    problem = tensor_problem(target)
    if problem is not None:
        hint = "; materialize it first (e.g. module.to_empty(device=...))" if target.is_meta else ""
        return f"the target cannot be written in place: {problem}{hint}"
    return None


def _allocate(spec: TensorSpec) -> torch.Tensor:
    """A new tensor for ``spec`` on its recorded device if this machine has it, else on CPU."""
    device = _device_here(spec.device)
    if spec.numel and _dense(spec.shape, spec.stride):
        tensor = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=device)
    else:  # overlapping or gapped layouts cannot be allocated as such; contiguous holds the values
        tensor = torch.empty(spec.shape, dtype=spec.dtype, device=device)
    if spec.requires_grad and (spec.dtype.is_floating_point or spec.dtype.is_complex):
        tensor.requires_grad_(True)
    return tensor


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Non-overlapping and without gaps (a permutation of a contiguous layout)."""
    expected = 1
    for step, size in sorted((s, n) for n, s in zip(shape, stride) if n != 1):
        if step != expected:
            return False
        expected *= size
    return True


def _device_here(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        return torch.device("cpu")
    if device.type == "cpu":
        return device
    backend: Any = getattr(torch, device.type, None)
    try:
        ok = bool(backend.is_available()) and (device.index is None or device.index < backend.device_count())
    except Exception:  # a backend without these functions: treat it as absent
        ok = False
    return device if ok else torch.device("cpu")


def _byte_contiguous(target: torch.Tensor, spec: TensorSpec) -> bool:
    """Target and stored layout are both row-major contiguous: byte ``i`` maps to byte ``i``."""
    if spec.numel == 0:
        return True
    expected = 1
    for n, s in reversed(list(zip(spec.shape, spec.stride))):
        if n != 1 and s != expected:
            return False
        expected *= n
    return target.is_contiguous()
