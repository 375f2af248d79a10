"""State-layer test support: a checkpoint simulated without storage (flatten -> clone spans)."""

from __future__ import annotations

import json
from typing import Any

import torch

from gpusnap.state import SpanInfo, flatten, plan_restore
from gpusnap.restore.apply_bytes import apply_all

__all__ = ["Snap", "snapshot", "restore"]

Snap = tuple[dict[str, Any], list[SpanInfo], dict[int, torch.Tensor]]


def snapshot(app_state: dict[str, Any]) -> Snap:
    """The tree (through a JSON round trip, as the manifest stores it) and cloned span bytes."""
    flat = flatten(app_state)
    tree = json.loads(json.dumps(flat.tree, allow_nan=False))
    infos = [SpanInfo(s.nbytes, str(s.device)) for s in flat.spans]
    return tree, infos, {s.index: s.as_bytes().clone() for s in flat.spans}


def restore(app_state: dict[str, Any], snap: Snap) -> None:
    tree, infos, data = snap
    apply_all(plan_restore(app_state, tree, infos), data)
