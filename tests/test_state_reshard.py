"""Resharding a ``dtensor`` node's pieces into a whole tensor, without processes: the box
arithmetic of state/reshard.py (uneven and empty shards, two mesh dimensions), refusals that
name the key, and the signature ranks compare."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpusnap.errors import RestoreMismatchError
from gpusnap.restore.apply_bytes import apply_span
from gpusnap.state.apply import plan_restore
from gpusnap.state.dtensor import intersect, slices
from gpusnap.state.targets import SpanInfo
from gpusnap.state.tree import signature, signature_lines

WHOLE = torch.arange(30, dtype=torch.float32).reshape(5, 6)


def _piece(storage: int, box: tuple[tuple[int, int], tuple[int, int]]) -> dict[str, Any]:
    (r, c), (h, w) = box
    local = {"t": "tensor", "storage": storage, "dtype": "float32", "shape": [h, w], "stride": [w, 1],
             "byte_offset": 0, "device": "cpu", "requires_grad": False}
    return {"offset": [r, c], "shape": [h, w], "local": local}


def _restore(boxes: list[tuple[tuple[int, int], tuple[int, int]]], placements: list[str]) -> torch.Tensor:
    node = {"t": "dtensor", "shape": [5, 6], "dtype": "float32", "mesh": [len(boxes)], "placements": placements,
            "coord": [0], "offset": [0, 0], "local_shape": [5, 6], "local": None, "own": None,
            "pieces": [_piece(i, b) for i, b in enumerate(boxes)]}
    data = [WHOLE[r:r + h, c:c + w].contiguous().view(-1).view(torch.uint8) for (r, c), (h, w) in boxes]
    target = torch.zeros(5, 6)
    plan = plan_restore({"w": target}, {"t": "dict", "items": [[{"t": "v", "v": "w"}, node]]},
                        [SpanInfo(d.numel(), "cpu") for d in data])
    assert plan.resharded == ("w",) and not any(plan.streamable(i) for i in range(len(data)) if plan.targets(i))
    for i, d in enumerate(data):
        apply_span(plan, i, d)
    plan.finish()
    return target


def test_uneven_row_shards_assemble() -> None:
    assert torch.equal(_restore([((0, 0), (2, 6)), ((2, 0), (2, 6)), ((4, 0), (1, 6))], ["S(0)"]), WHOLE)


def test_two_mesh_dims_with_an_empty_shard_assemble() -> None:
    boxes = [((0, 0), (3, 4)), ((0, 4), (3, 2)), ((3, 0), (2, 4)), ((3, 4), (2, 2)), ((5, 0), (0, 4))]
    assert torch.equal(_restore(boxes, ["S(0)", "S(1)"]), WHOLE)


def test_missing_pieces_and_partial_are_refused_by_key() -> None:
    with pytest.raises(RestoreMismatchError, match=r"w: the checkpoint's pieces .* cover 12 of the 30"):
        _restore([((0, 0), (2, 6))], ["S(0)"])
    with pytest.raises(RestoreMismatchError, match=r"w: cannot reshard .*Partial"):
        _restore([((0, 0), (5, 6))], ["P(sum)"])


def test_boxes() -> None:
    assert intersect(((0, 0), (3, 4)), ((2, 2), (3, 4))) == ((2, 2), (1, 2))
    assert intersect(((0, 0), (2, 2)), ((2, 0), (2, 2))) is None
    assert slices(((2, 2), (1, 2)), ((2, 0), (3, 6))) == (slice(0, 1), slice(2, 4))


def test_signature_names_keys_kinds_and_global_shapes() -> None:
    tensor = {"t": "tensor", "dtype": "float32", "shape": [3]}
    a = {"t": "dict", "items": [[{"t": "v", "v": "m"}, {"t": "module", "entries": {"t": "dict", "items": [
        [{"t": "v", "v": "w"}, tensor]]}}], [{"t": "v", "v": "step"}, {"t": "v", "v": 1}]]}
    assert signature_lines(a) == ["m/w: tensor float32 [3]", "step: v"]
    b = {**a, "items": [a["items"][0], [{"t": "v", "v": "step"}, {"t": "v", "v": 2}]]}
    assert signature(a) == signature(b)  # values may differ per rank; keys, kinds and shapes may not
