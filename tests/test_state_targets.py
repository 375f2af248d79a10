"""``state`` hands back frozen restore targets; the bytes are copied by ``restore.apply_bytes``.

The plan's targets are typed and immutable (a restore path cannot retarget a span by
accident), the books of what was applied stay with the plan, and ``state`` imports nothing of
``restore`` (layers: DESIGN.md).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from state_support import snapshot

from gpusnap import CheckpointError
from gpusnap.restore.apply_bytes import apply_range, apply_span
from gpusnap.state import ByteTarget, SpanTarget, TensorSpec, plan_restore

STATE = Path(__file__).resolve().parents[1] / "src" / "gpusnap" / "state"


def _plan(target: dict, source: dict):  # noqa: ANN001, ANN202
    tree, infos, data = snapshot(source)
    return plan_restore(target, tree, infos), data


def test_span_targets_are_frozen_and_typed() -> None:
    source = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(3.0)}
    target = {k: torch.zeros_like(v) for k, v in source.items()}
    plan, _ = _plan(target, source)
    targets = [t for i in plan.span_paths for t in plan.span_targets(i)]
    assert {t.path for t in targets} == {"w", "b"}
    for t in targets:
        assert isinstance(t, SpanTarget) and isinstance(t.spec, TensorSpec)
        assert any(t.target is v for v in target.values())
        with pytest.raises(dataclasses.FrozenInstanceError):
            t.path = "other"  # type: ignore[misc]
        with pytest.raises(dataclasses.FrozenInstanceError):
            t.spec.byte_offset = 4  # type: ignore[misc]
    assert isinstance(plan.span_targets(0), tuple)


def test_byte_targets_are_frozen_and_cover_each_target() -> None:
    source = {"w": torch.arange(12.0).reshape(3, 4)}
    target = {"w": torch.zeros(3, 4)}
    plan, _ = _plan(target, source)
    (index,) = [i for i, paths in plan.span_paths.items() if paths]
    (bt,) = plan.byte_targets(index)
    assert isinstance(bt, ByteTarget) and (bt.start, bt.stop, bt.path, bt.inference) == (0, 48, "w", False)
    assert bt.dst.dtype == torch.uint8 and bt.dst.data_ptr() == target["w"].data_ptr()
    with pytest.raises(dataclasses.FrozenInstanceError):
        bt.stop = 0  # type: ignore[misc]
    assert plan.byte_targets(index) is plan.byte_targets(index)  # built once per span


def test_the_plan_keeps_the_books_restore_copies_the_bytes() -> None:
    source = {"w": torch.arange(1000.0)}
    target = {"w": torch.zeros(1000)}
    plan, data = _plan(target, source)
    (index,) = [i for i, paths in plan.span_paths.items() if paths]
    apply_range(plan, index, 0, data[index][:1000])
    assert index in plan.pending_spans  # claimed in part
    apply_range(plan, index, 1000, data[index][1000:])
    assert index not in plan.pending_spans and torch.equal(target["w"], source["w"])
    with pytest.raises(CheckpointError, match="already applied"):
        apply_span(plan, index, data[index])


def test_state_imports_nothing_of_restore() -> None:
    for path in STATE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                assert "restore" not in name.split("."), f"{path.name} imports {name}"
