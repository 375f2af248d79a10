"""CUDA paths: pinned host sources, device sources, created state on the recorded device."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

from gpusnap.state import SpanInfo, flatten, plan_restore
from gpusnap.restore.apply_bytes import apply_all

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def capture(app_state: dict[str, Any], host: bool) -> tuple[dict[str, Any], list[SpanInfo], dict[int, torch.Tensor]]:
    flat = flatten(app_state)
    tree = json.loads(json.dumps(flat.tree, allow_nan=False))
    data = {}
    for span in flat.spans:
        raw = span.as_bytes()
        assert raw.device == span.device and raw.data_ptr() == span.storage.data_ptr() + span.start
        data[span.index] = raw.cpu().pin_memory() if host else raw.clone()
    return tree, [SpanInfo(s.nbytes, str(s.device)) for s in flat.spans], data


def trained(device: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4)).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        optim.zero_grad()
        model(torch.randn(8, 16, device=device)).square().mean().backward()
        optim.step()
    return {"model": model, "optim": optim}


def bits(app_state: dict[str, Any]) -> list[torch.Tensor]:
    tensors = list(app_state["model"].state_dict().values())
    tensors += [v for s in app_state["optim"].state.values() for _, v in sorted(s.items())]
    return [t.detach().reshape(-1).cpu().view(torch.uint8) for t in tensors]


@pytest.mark.parametrize("host", [True, False], ids=["pinned-host", "device"])
def test_cuda_restore_in_place(host: bool) -> None:
    app_state = trained("cuda")
    tree, infos, data = capture(app_state, host)
    expected = bits(app_state)
    pointers = [p.data_ptr() for p in app_state["model"].parameters()]
    for p in app_state["model"].parameters():
        p.data.normal_()
    for state in app_state["optim"].state.values():
        state["exp_avg"].zero_()
    apply_all(plan_restore(app_state, tree, infos), data)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(bits(app_state), expected))
    assert [p.data_ptr() for p in app_state["model"].parameters()] == pointers


def test_cuda_optimizer_state_created_on_recorded_device() -> None:
    source = trained("cuda")
    tree, infos, data = capture(source, host=True)
    target = trained("cuda")
    target["optim"] = torch.optim.AdamW(target["model"].parameters(), lr=1e-2)
    apply_all(plan_restore(target, tree, infos), data)
    torch.cuda.synchronize()
    for p, state in target["optim"].state.items():
        assert state["exp_avg"].device == p.device
    assert all(torch.equal(a, b) for a, b in zip(bits(target), bits(source)))


def test_cuda_checkpoint_into_cpu_program() -> None:
    source = trained("cuda")
    tree, infos, data = capture(source, host=False)
    target = trained("cpu")
    target["optim"] = torch.optim.AdamW(target["model"].parameters(), lr=1e-2)
    apply_all(plan_restore(target, tree, infos), data)
    for p, state in target["optim"].state.items():
        assert state["exp_avg"].device == p.device == torch.device("cpu")
    assert all(torch.equal(a, b) for a, b in zip(bits(target), bits(source)))
