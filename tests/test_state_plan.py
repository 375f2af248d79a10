"""RestorePlan mechanics: spans in any order, finish before or after them, strict bookkeeping."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from state_support import Snap, snapshot
from torch import nn

from gpusnap.errors import CheckpointError
from gpusnap.state import RestorePlan, plan_restore
from gpusnap.restore.apply_bytes import apply_all, apply_span


def plan(app_state: dict[str, Any], snap: Snap) -> RestorePlan:
    return plan_restore(app_state, snap[0], snap[1])


def trained() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(2, 3)).sum().backward()
        optim.step()
    return {"model": model, "optim": optim, "step": 2}


def flat_bits(app_state: dict[str, Any]) -> list[torch.Tensor]:
    tensors = list(app_state["model"].state_dict().values())
    tensors += [v for s in app_state["optim"].state.values() for _, v in sorted(s.items())]
    return [t.detach().reshape(-1).clone().view(torch.uint8) for t in tensors]


def test_spans_in_any_order_and_finish_first_lazy_style() -> None:
    source = trained()
    snap = snapshot(source)
    expected = flat_bits(source)
    target = trained()
    target["optim"] = torch.optim.Adam(target["model"].parameters(), lr=0.1)  # empty state: created
    with torch.no_grad():
        for p in target["model"].parameters():
            p.zero_()
    target["step"] = 0
    restore = plan(target, snap)
    restore.finish()  # before any byte: the optimizer must already hold the tensors to be filled
    assert target["step"] == 2 and len(target["optim"].state) == 4
    for index in reversed(range(len(snap[1]))):
        apply_span(restore, index, snap[2][index])
    assert not restore.pending_spans
    assert all(torch.equal(a, b) for a, b in zip(flat_bits(target), expected))


def test_span_paths_and_stateful_spans() -> None:
    app_state = trained()
    snap = snapshot(app_state)
    restore = plan(app_state, snap)
    paths = {i: p for i, p in restore.span_paths.items()}
    assert paths[0] == ["model/0.weight"]
    stateful = {p for i in restore.stateful_spans for p in paths[i]}
    assert "optim/state/0/exp_avg" in stateful and not any(p.startswith("model/") for p in stateful)


def test_bookkeeping_errors() -> None:
    app_state = {"a": torch.zeros(4), "b": torch.zeros(2)}
    snap = snapshot(app_state)
    restore = plan(app_state, snap)
    with pytest.raises(CheckpointError, match="does not exist"):
        apply_span(restore, 5, snap[2][0])
    with pytest.raises(CheckpointError, match="16 bytes"):
        apply_span(restore, 0, torch.zeros(15, dtype=torch.uint8))
    with pytest.raises(CheckpointError, match="uint8"):
        apply_span(restore, 0, torch.zeros(4))
    with pytest.raises(CheckpointError, match=r"span\(s\) \[1\]"):
        apply_all(restore, {0: snap[2][0]})
    assert app_state["a"].eq(0).all()  # refused before writing
    apply_span(restore, 1, snap[2][1])
    with pytest.raises(CheckpointError, match="already applied"):
        apply_span(restore, 1, snap[2][1])
    restore.finish()
    with pytest.raises(CheckpointError, match="already called"):
        restore.finish()


def test_unaligned_source_buffer() -> None:
    value = torch.tensor([1.5, -2.25, float("nan")], dtype=torch.float64)
    app_state = {"v": value}
    snap = snapshot(app_state)
    host = torch.zeros(snap[1][0].nbytes + 3, dtype=torch.uint8)
    host[3:] = snap[2][0]
    expected = value.clone().view(torch.int64)
    value.zero_()
    apply_all(plan(app_state, snap), {0: host[3:]})
    assert torch.equal(value.view(torch.int64), expected)


def test_created_tensor_falls_back_to_cpu_when_device_absent() -> None:
    class Holder:
        def __init__(self) -> None:
            self.state: dict[str, Any] = {}

        def state_dict(self) -> dict[str, Any]:
            return dict(self.state)

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.state = dict(state)

    source = Holder()
    source.state = {"buf": torch.arange(6.0).view(2, 3).t(), "count": 3}
    snap = snapshot({"h": source})
    node = snap[0]["items"][0][1]["state"]["items"][0][1]
    node["device"] = "cuda:63"  # a device this machine does not have
    target = Holder()
    apply_all(plan_restore({"h": target}, snap[0], snap[1]), snap[2])
    assert target.state["count"] == 3
    buf = target.state["buf"]
    assert buf.device.type == "cpu" and buf.stride() == (1, 3)  # dense layout kept
    assert torch.equal(buf, torch.arange(6.0).view(2, 3).t())


class _WithExtra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.note = {"calls": 0}

    def get_extra_state(self) -> Any:
        return dict(self.note)

    def set_extra_state(self, state: Any) -> None:
        self.note = dict(state)


def test_module_extra_state_goes_through_load_state_dict() -> None:
    model = _WithExtra()
    model.note["calls"] = 5
    snap = snapshot({"m": model})
    expected = model.lin.weight.detach().clone()
    model.note["calls"] = 9
    with torch.no_grad():
        model.lin.weight.zero_()
    apply_all(plan({"m": model}, snap), snap[2])
    assert model.note == {"calls": 5} and torch.equal(model.lin.weight, expected)


def test_plain_module_does_not_call_load_state_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(2, 2)
    snap = snapshot({"m": model})
    expected = copy.deepcopy(model.state_dict())

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("load_state_dict must not run: the tensors were restored in place")

    monkeypatch.setattr(model, "load_state_dict", forbidden)
    with torch.no_grad():
        model.weight.add_(1)
    apply_all(plan({"m": model}, snap), snap[2])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())


def test_inference_tensor_target() -> None:
    with torch.inference_mode():
        cache = torch.arange(8.0)
    snap = snapshot({"kv": cache})
    with torch.inference_mode():
        cache.zero_()
    apply_all(plan({"kv": cache}, snap), snap[2])
    assert torch.equal(cache, torch.arange(8.0))


def test_parameter_requires_grad_and_autograd_untouched() -> None:
    weight = nn.Parameter(torch.ones(3))
    snap = snapshot({"w": weight})
    with torch.no_grad():
        weight.mul_(3)
    apply_all(plan({"w": weight}, snap), snap[2])
    assert weight.requires_grad and weight.grad_fn is None and weight.is_leaf
    assert torch.equal(weight.detach(), torch.ones(3))


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda n: n.update(storage=7), "storage 7"),
        (lambda n: n.update(byte_offset=8), "inconsistent"),
        (lambda n: n.update(dtype="float99"), "unknown dtype"),
        (lambda n: n.update(shape=[2, 2]), "malformed"),
        (lambda n: n.update(t="tensorish"), "unknown"),
    ],
)
def test_corrupt_tensor_node_is_a_checkpoint_error(edit: Any, needle: str) -> None:
    value = torch.zeros(4)
    snap = snapshot({"v": value})
    edit(snap[0]["items"][0][1])
    with pytest.raises(CheckpointError, match=needle):
        plan({"v": value}, snap)
