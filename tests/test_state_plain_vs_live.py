"""A plain value in the checkpoint never replaces a live tensor, module or Stateful object of
app_state: that is a RestoreMismatchError naming the key, raised before any byte moves, in
strict and non-strict restores alike (the checkpoint's plain values still replace plain ones)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from restore_support import tiny_config
from state_support import snapshot
from test_state_mismatch import fails
from torch import nn

import gpusnap
from gpusnap.errors import RestoreMismatchError
from gpusnap.state import plan_restore
from gpusnap.restore.apply_bytes import apply_all


@pytest.mark.parametrize("live", [torch.ones(2), nn.Linear(2, 2), gpusnap.RNGState()],
                         ids=["tensor", "module", "stateful"])
def test_a_plain_value_does_not_overwrite_a_live_object(live: object) -> None:
    snap = snapshot({"w": 3, "x": torch.zeros(1)})
    message = fails({"w": live, "x": torch.ones(1)}, snap)
    assert "w:" in message and "plain value" in message


def test_a_plain_container_does_not_empty_a_live_dict_of_tensors() -> None:
    snap = snapshot({"bufs": {"n": 1}})
    live = {"bufs": {"n": torch.ones(1)}}
    tree, infos, _ = snap
    with pytest.raises(RestoreMismatchError, match="bufs"):
        plan_restore(live, tree, infos, strict=False)
    assert torch.equal(live["bufs"]["n"], torch.ones(1))


def test_plain_values_still_replace_plain_values() -> None:
    tree, infos, _ = snapshot({"step": 3, "cfg": {"lr": 0.1}})
    state = {"step": "old", "cfg": {"lr": 1.0, "extra": 2}}
    plan_restore(state, tree, infos).finish()
    assert state == {"step": 3, "cfg": {"lr": 0.1}}


def test_restore_through_the_checkpointer_leaves_the_tensor_in_place(tmp_path: Path) -> None:
    with gpusnap.Checkpointer(tmp_path, config=tiny_config()) as ck:
        ck.save({"w": None, "step": 1}, blocking=True).wait()
        w = torch.arange(4.0)
        state = {"w": w, "step": 0}
        with pytest.raises(RestoreMismatchError, match="w: the checkpoint has a plain value"):
            ck.restore(state)
        assert state["w"] is w and torch.equal(w, torch.arange(4.0)) and state["step"] == 0


def test_a_dict_of_tensors_restores_into_a_module_and_an_optimizer_state_into_an_optimizer() -> None:
    torch.manual_seed(0)
    source = nn.Linear(3, 2)
    optim = torch.optim.AdamW(source.parameters())
    source(torch.randn(4, 3)).sum().backward()
    optim.step()
    sgd = torch.optim.SGD([torch.zeros(1)], lr=0.5)  # no tensor in its state: a plain dict node
    saved = {"model": dict(source.state_dict()), "optim": optim.state_dict(), "sgd": sgd.state_dict()}
    tree, infos, data = snapshot(saved)
    target = nn.Linear(3, 2)
    target_optim = torch.optim.AdamW(target.parameters())
    target_sgd = torch.optim.SGD([torch.zeros(1)], lr=0.1)
    weight = target.weight
    apply_all(plan_restore({"model": target, "optim": target_optim, "sgd": target_sgd}, tree, infos), data)
    assert target.weight is weight and torch.equal(target.weight, source.weight)
    assert torch.equal(target.bias, source.bias)
    restored = target_optim.state_dict()["state"]
    for index, moments in optim.state_dict()["state"].items():
        assert all(torch.equal(restored[index][k], v) for k, v in moments.items())
    assert target_sgd.param_groups[0]["lr"] == 0.5


def test_a_dict_for_a_module_is_still_checked_key_by_key() -> None:
    tree, infos, _ = snapshot({"model": {"weight": torch.zeros(2, 3)}})
    message = fails({"model": nn.Linear(3, 2)}, (tree, infos, {}))
    assert "bias" in message
