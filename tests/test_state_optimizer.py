"""Model + AdamW + LR scheduler: restore is exact, in place, and training resumes bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from state_support import restore, snapshot
from torch import nn

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
    ),
]


def make(device: str, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return {"model": model, "optim": optim, "sched": sched, "step": 0}


def train(app_state: dict[str, Any], steps: int, salt: int = 0) -> None:
    model, optim, sched = app_state["model"], app_state["optim"], app_state["sched"]
    for _ in range(steps):
        gen = torch.Generator().manual_seed(1000 * salt + app_state["step"])
        x = torch.randn(5, 8, generator=gen).to(next(model.parameters()).device)
        optim.zero_grad()
        model(x).square().mean().backward()
        optim.step()
        sched.step()
        app_state["step"] += 1


def state_bits(app_state: dict[str, Any]) -> list[torch.Tensor]:
    tensors = list(app_state["model"].state_dict().values())
    for per_param in app_state["optim"].state.values():
        tensors += [v for _, v in sorted(per_param.items())]
    return [t.detach().cpu().reshape(-1).clone().view(torch.uint8) for t in tensors]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("device", DEVICES)
def test_restore_in_place_keeps_objects_and_pointers(device: str) -> None:
    app_state = make(device, seed=0)
    train(app_state, 3)
    snap = snapshot(app_state)
    expected = state_bits(app_state)
    expected_sched = app_state["sched"].state_dict()
    expected_lr = [g["lr"] for g in app_state["optim"].param_groups]
    optim = app_state["optim"]
    state_objects = {(id(p), k): v for p, s in optim.state.items() for k, v in s.items()}
    pointers = {key: v.data_ptr() for key, v in state_objects.items()}
    param_pointers = [p.data_ptr() for p in app_state["model"].parameters()]

    train(app_state, 2, salt=1)
    restore(app_state, snap)

    assert app_state["step"] == 3
    assert_same(state_bits(app_state), expected)
    assert app_state["sched"].state_dict() == expected_sched
    assert [g["lr"] for g in optim.param_groups] == expected_lr
    assert [p.data_ptr() for p in app_state["model"].parameters()] == param_pointers
    for p, s in optim.state.items():
        for k, v in s.items():
            assert v is state_objects[(id(p), k)] and v.data_ptr() == pointers[(id(p), k)]


@pytest.mark.parametrize("device", DEVICES)
def test_training_resumes_bit_exactly(device: str) -> None:
    reference = make(device, seed=0)
    train(reference, 6)

    app_state = make(device, seed=0)
    train(app_state, 3)
    snap = snapshot(app_state)
    train(app_state, 2, salt=1)  # diverge
    restore(app_state, snap)
    train(app_state, 3)
    assert_same(state_bits(app_state), state_bits(reference))


@pytest.mark.parametrize("device", DEVICES)
def test_fresh_optimizer_state_is_created_and_training_matches(device: str) -> None:
    reference = make(device, seed=0)
    train(reference, 6)

    source = make(device, seed=0)
    train(source, 3)
    snap = snapshot(source)

    fresh = make(device, seed=123)  # other weights, empty optimizer state
    assert not fresh["optim"].state
    restore(fresh, snap)
    assert len(fresh["optim"].state) == len(list(fresh["model"].parameters()))
    for p, s in fresh["optim"].state.items():
        assert s["exp_avg"].device == p.device and s["exp_avg"].shape == p.shape
        assert s["step"].device.type == "cpu"  # as recorded: AdamW keeps non-capturable steps on the host
    assert_same(state_bits(fresh), state_bits(source))
    train(fresh, 3)
    assert_same(state_bits(fresh), state_bits(reference))


def test_scheduler_alone() -> None:
    optim = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=1.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=10)
    for _ in range(4):
        optim.step()
        sched.step()
    app_state = {"sched": sched}
    snap = snapshot(app_state)
    expected = sched.state_dict()
    for _ in range(3):
        optim.step()
        sched.step()
    restore(app_state, snap)
    assert sched.state_dict() == expected and sched.get_last_lr() == expected["_last_lr"]
