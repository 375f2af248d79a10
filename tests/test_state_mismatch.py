"""A target that does not fit raises one RestoreMismatchError listing every problem, writing nothing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from state_support import Snap, snapshot
from torch import nn

from gpusnap.errors import RestoreMismatchError
from gpusnap.state import plan_restore


def fails(app_state: dict[str, Any], snap: Snap) -> str:
    """Plan the restore, expect a mismatch, and check nothing in app_state changed."""
    tensors = [v for v in app_state.values() if isinstance(v, torch.Tensor)]
    for value in app_state.values():
        if isinstance(value, nn.Module):
            tensors += list(value.state_dict().values())
    before = [t.detach().clone() for t in tensors]
    plain = dict(app_state)
    tree, infos, _ = snap
    with pytest.raises(RestoreMismatchError) as err:
        plan_restore(app_state, tree, infos)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    assert all(app_state[k] is v for k, v in plain.items())
    return str(err.value)


def test_shape_mismatch_names_path_and_both_shapes() -> None:
    snap = snapshot({"w": torch.zeros(2, 3), "step": 1})
    message = fails({"w": torch.ones(3, 3), "step": 5}, snap)
    assert "w:" in message and "[2, 3]" in message and "[3, 3]" in message


def test_dtype_mismatch_names_both_dtypes() -> None:
    snap = snapshot({"w": torch.zeros(4, dtype=torch.bfloat16)})
    message = fails({"w": torch.ones(4, dtype=torch.float16)}, snap)
    assert "bfloat16" in message and "float16" in message


def test_top_level_keys_must_match_both_ways() -> None:
    snap = snapshot({"a": 1, "b": torch.zeros(1)})
    message = fails({"b": torch.ones(1), "c": 2}, snap)
    assert "'a'" in message and "'c'" in message


def test_module_keys_and_shapes_all_reported_at_once() -> None:
    source = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    target = nn.Sequential(nn.Linear(4, 5), nn.Linear(3, 2), nn.Linear(2, 2))
    snap = snapshot({"model": source})
    message = fails({"model": target}, snap)
    assert "model/0.weight" in message and "[3, 4]" in message and "[5, 4]" in message
    assert "model/0.bias" in message
    assert "2.weight" in message and "2.bias" in message  # missing from the checkpoint


def test_list_length_mismatch() -> None:
    snap = snapshot({"bufs": [torch.zeros(1), torch.zeros(1)]})
    message = fails({"bufs": [torch.ones(1)]}, snap)
    assert "bufs" in message and "length 2" in message


def test_kind_mismatch() -> None:
    snap = snapshot({"w": torch.zeros(2), "m": nn.Linear(1, 1)})
    message = fails({"w": 3, "m": {"weight": torch.ones(1, 1)}}, snap)
    assert "w:" in message and "int" in message and "nn.Module" in message


def test_optimizer_state_shape_mismatch() -> None:
    def make(width: int) -> dict[str, Any]:
        torch.manual_seed(0)
        model = nn.Linear(2, width)
        optim = torch.optim.Adam(model.parameters())
        model(torch.ones(1, 2)).sum().backward()
        optim.step()
        return {"model": model, "optim": optim}

    snap = snapshot(make(3))
    target = make(4)
    exp_avg = target["optim"].state[target["model"].weight]["exp_avg"]
    before = exp_avg.clone()
    message = fails(target, snap)
    assert "optim/state/0/exp_avg" in message and "[3, 2]" in message and "[4, 2]" in message
    assert torch.equal(exp_avg, before)


def test_untied_in_checkpoint_but_tied_here() -> None:
    snap = snapshot({"a": torch.zeros(2), "b": torch.ones(2)})
    shared = torch.full((2,), 5.0)
    message = fails({"a": shared, "b": shared}, snap)
    assert "b:" in message and "stores them apart" in message
