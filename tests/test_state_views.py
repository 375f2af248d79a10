"""Views and tied tensors share one storage: one span, stored once, restored consistently."""

from __future__ import annotations

import gc
import json
from typing import Any

import torch
from torch import nn

from gpusnap.state import SpanInfo, flatten, plan_restore
from gpusnap.restore.apply_bytes import apply_all


def snapshot(app_state: dict[str, Any]) -> tuple[dict[str, Any], list[SpanInfo], dict[int, torch.Tensor]]:
    flat = flatten(app_state)
    tree = json.loads(json.dumps(flat.tree, allow_nan=False))
    infos = [SpanInfo(s.nbytes, str(s.device)) for s in flat.spans]
    return tree, infos, {s.index: s.as_bytes().clone() for s in flat.spans}


def restore(app_state: dict[str, Any], snap: tuple[dict[str, Any], list[SpanInfo], dict[int, torch.Tensor]]) -> None:
    tree, infos, data = snap
    apply_all(plan_restore(app_state, tree, infos), data)


def tensor_nodes(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        found = [node] if node.get("t") == "tensor" else []
        return found + [n for v in node.values() for n in tensor_nodes(v)]
    if isinstance(node, (list, tuple)):
        return [n for v in node for n in tensor_nodes(v)]
    return []


def test_views_of_one_storage_make_one_span_covering_their_extent() -> None:
    base = torch.arange(100, dtype=torch.float32)
    app_state = {"a": base[10:20], "b": base[50:60].view(2, 5).t(), "c": base[15:30:3]}
    flat = flatten(app_state)
    assert len(flat.spans) == 1
    span = flat.spans[0]
    assert (span.start, span.end, span.nbytes) == (40, 240, 200)
    assert span.paths == ["a", "b", "c"]
    offsets = [n["byte_offset"] for n in tensor_nodes(flat.tree)]
    assert offsets == [0, 160, 20]
    assert list(tensor_nodes(flat.tree)[1]["stride"]) == [1, 5]


def test_as_bytes_aliases_the_span_without_copy() -> None:
    base = torch.zeros(16, dtype=torch.int32)
    span = flatten({"v": base[2:6]}).spans[0]
    raw = span.as_bytes()
    assert raw.dtype == torch.uint8 and raw.numel() == 16
    assert raw.data_ptr() == base.data_ptr() + 8
    raw.fill_(1)
    assert base[2:6].eq(0x01010101).all() and base[:2].eq(0).all() and base[6:].eq(0).all()


def test_views_restore_consistently_and_gaps_are_untouched() -> None:
    base = torch.arange(100, dtype=torch.float32)
    app_state = {"a": base[10:20], "b": base[50:60].view(2, 5).t(), "c": base[15:30:3]}
    snap = snapshot(app_state)
    expected = base.clone()
    base.mul_(-1)
    gap_before = base[30:50].clone()
    restore(app_state, snap)
    assert torch.equal(base[10:20], expected[10:20]) and torch.equal(base[50:60], expected[50:60])
    assert torch.equal(base[15:30:3], expected[15:30:3])
    assert torch.equal(base[30:50], gap_before)  # not in app_state: not written
    assert base[22] == -22.0  # between two elements of the strided view: not written either


def test_views_of_different_dtypes_at_odd_offsets() -> None:
    raw = torch.arange(64, dtype=torch.uint8)
    app_state = {"byte": raw[3:4], "floats": raw[8:24].view(torch.float32), "halfs": raw[40:48].view(torch.float16)}
    flat = flatten(app_state)
    assert len(flat.spans) == 1 and flat.spans[0].start == 3
    snap = snapshot(app_state)
    expected = raw.clone()
    raw.fill_(0)
    restore(app_state, snap)
    for lo, hi in ((3, 4), (8, 24), (40, 48)):
        assert torch.equal(raw[lo:hi], expected[lo:hi])


def test_tied_weights_are_one_storage_stored_once() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    flat = flatten({"model": model})
    assert len(flat.spans) == 1
    assert flat.spans[0].paths == ["model/0.weight", "model/1.weight"]
    assert flat.spans[0].nbytes == 10 * 4 * 4
    snap = snapshot({"model": model})
    expected = model[0].weight.detach().clone()
    with torch.no_grad():
        model[0].weight.add_(1)
    restore({"model": model}, snap)
    assert model[1].weight is model[0].weight
    assert torch.equal(model[0].weight, expected)


def test_empty_tensors_and_empty_storages_have_no_bytes() -> None:
    big = torch.arange(10.0)
    app_state = {"e": torch.empty(0), "z": torch.zeros(3, 0, 2), "slice": big[4:4], "full": big[2:3]}
    flat = flatten(app_state)
    nbytes = {tuple(s.paths): s.nbytes for s in flat.spans}
    assert nbytes[("e",)] == 0 and nbytes[("z",)] == 0
    assert nbytes[("slice", "full")] == 4  # the empty view adds nothing to the extent
    assert all(n["byte_offset"] >= 0 for n in tensor_nodes(flat.tree))
    snap = snapshot(app_state)
    big.zero_()
    restore(app_state, snap)
    assert big[2] == 2.0 and big.sum() == 2.0


def test_storage_identity_not_data_pointer() -> None:
    # Two empty tensors may report the same (null) data pointer yet are different storages.
    a, b = torch.empty(0), torch.empty(0)
    flat = flatten({"a": a, "b": b})
    assert len(flat.spans) == 2


def test_span_keeps_storage_alive() -> None:
    app_state = {"t": torch.full((1024,), 7.0)}
    flat = flatten(app_state)
    del app_state
    gc.collect()
    garbage = torch.full((1024,), -1.0)  # would reuse the freed block if the span let it go
    assert flat.spans[0].as_bytes().view(torch.float32).eq(7.0).all()
    del garbage
