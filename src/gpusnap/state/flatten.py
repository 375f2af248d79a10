"""Flatten an ``app_state`` mapping into a JSON-able tree plus the storage spans to copy.

The walk itself is in :mod:`gpusnap.state.walker`, the types it produces in
:mod:`gpusnap.state.flat` (both re-exported here).

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

The walk is planned too (``replay*`` in :mod:`gpusnap.state.walker`). A walk given a plan
notes each container's *shape* (its keys in order and their exact types, the exact type of each item, how each item
was walked) in the plan's memo (:class:`_Replay`), and the next walk follows it: a dict with
the same keys and item types hands its tensors over in one list, its key nodes and paths
come from the shape, and the layouts are read and compared a whole column at a time (a C
loop per column, no Python per tensor). A container that differs in any way (a key added,
removed, renamed or moved, an item of another type, a dict turned Stateful) is walked in
full, and the layout comparison decides as before; what the plan is reused for does not
depend on the shapes. The nodes of the tensors are the plan's own, and so are the nodes of
containers of tensors only (a state_dict, an optimizer's ``state``): trees of planned walks
share them, and must only be read (the manifest writes them out; nothing changes them). A
walk that does not match swaps the plan's nodes out of its tree, copying the containers on
the way, before working its nodes out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointError
from .flat import FlatPlan, FlatState, Stateful, StorageSpan, _Replay, is_stateful, tensor_extent, tensor_problem
from .plain import type_name
from .walker import _SHAPED_MAPPINGS, _Walker

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


def flatten(app_state: Mapping[str, Any], *, allow_pickle: bool = False, plan: FlatPlan | None = None) -> FlatState:
    """Tree and spans of ``app_state``; CheckpointError naming the key path of anything unstorable.

    ``plan``: the previous result's ``plan``; reused when every tensor is laid out as then.
    """
    if not isinstance(app_state, Mapping):
        raise CheckpointError(f"app_state must be a mapping, got {type_name(app_state)}")
    walker = _Walker(allow_pickle, plan)
    replay = plan.replay if plan is not None else None
    root = replay.root if replay is not None else None
    if root is not None and type(app_state) is root[0]:
        tree = walker.replay_mapping(app_state, root[1], "")  # the root is never guarded
    else:
        walker.noting = walker.noting and type(app_state) in _SHAPED_MAPPINGS  # else no root shape
        tree = walker.walk_mapping(app_state, "")
        walker.fallbacks += 1
    if plan is None:
        spans = walker.spans_in_full()
        return FlatState(tree=tree, spans=spans, plan=walker.plan(spans, _Replay()))
    assert replay is not None
    storages = walker.same_layouts(plan)
    if storages is not None:  # every node is the plan's
        if walker.fallbacks:  # the next walk follows this one's containers
            replay.root, replay.made = walker.root(app_state, tree), {}
        else:
            replay.made.update(walker.made)
        return FlatState(tree=tree, spans=walker.spans_from(plan, storages), plan=plan, planned=True)
    replay = _Replay(walker.root(app_state, tree))
    tree = walker.unshare(tree, plan)
    spans = walker.spans_in_full()
    return FlatState(tree=tree, spans=spans, plan=walker.plan(spans, replay))
