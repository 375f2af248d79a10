"""``resume(lazy=True)``: the program runs at once and always computes on resumed bytes.

Whatever order the copy thread and the program run in, an op (or a read no op shows, such
as ``tolist``) touching a storage not back yet waits for it, and a write the program makes
right after ``resume()`` is never overwritten by the copy that follows it. The assertions are
on outcomes, which hold for every interleaving; the states are large enough (hundreds of
storages) that the program usually runs ahead of the copy thread.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import gpusnap
from gpusnap import CheckpointError
from gpusnap.moving import suspend


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32)) for _ in range(48)]).to(device)


def test_the_first_forward_after_a_lazy_resume_is_bit_equal(device: torch.device) -> None:
    model = _model(device)
    x = torch.randn(4, 32, device=device)
    with torch.no_grad():
        expected = model(x)
    s = suspend({"model": model}, device=device)
    s.resume(lazy=True)
    with torch.no_grad():
        got = model(x)  # runs as the bytes come back
    assert torch.equal(got, expected)
    stats = s.wait()
    assert s.state == "resumed" and stats.lazy and stats.resumed_bytes == stats.bytes
    # both recorded; in either order: the copy thread may bring every byte back before
    # resume() has returned (a small state, a busy machine), which is no error
    assert stats.resume_return_s is not None and stats.resume_s is not None
    assert stats.resume_return_s >= 0 and stats.resume_s >= 0


@pytest.mark.parametrize("trial", range(4))  # (without the gate, most trials lose a write: measured 12 in 20)
def test_writes_right_after_a_lazy_resume_are_kept(device: torch.device, trial: int) -> None:
    model = _model(device)
    expected = [p.detach() + 1 for p in model.parameters()]
    s = suspend({"model": model}, device=device)
    s.resume(lazy=True)
    with torch.no_grad():
        for p in reversed(list(model.parameters())):  # last first: the copy thread starts at the front
            p.add_(1)
    s.wait()
    for p, e in zip(model.parameters(), expected):
        assert torch.equal(p, e)


def test_reads_no_op_shows_wait_for_their_bytes(device: torch.device) -> None:
    tensors = {f"t{i}": torch.full((64,), float(i), device=device) for i in range(200)}
    s = suspend(tensors, device=device)
    s.resume(lazy=True)
    assert tensors["t199"].tolist() == [199.0] * 64  # a door: no ATen op the gate sees
    assert f"{tensors['t150'][0].item():.0f}" == "150"
    s.wait()


def test_the_gate_is_gone_once_the_resume_is_over(device: torch.device) -> None:
    t = torch.randn(16, device=device)
    s = suspend({"t": t}, device=device)
    s.resume(lazy=True)
    s.wait()
    assert not any(type(m).__name__ == "GateMode" for m in _get_current_dispatch_mode_stack())
    with pytest.raises(CheckpointError, match="resumed already"):
        s.resume(lazy=True)


def test_a_save_during_a_lazy_resume_holds_the_resumed_bytes(tmp_path, device: torch.device) -> None:
    model = _model(device)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    s = suspend({"model": model}, device=device)
    with gpusnap.Checkpointer(tmp_path / "ck") as ck:
        s.resume(lazy=True)
        ck.save({"model": model}, blocking=True)  # waits for the resume, as for a lazy restore
        assert s.done()
        fresh = _model(device)
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        ck.restore({"model": fresh})
    for n, p in fresh.named_parameters():
        assert torch.equal(p, expected[n]), n


def test_a_second_resume_while_one_is_running_is_refused(device: torch.device) -> None:
    model = _model(device)
    s = suspend({"model": model}, device=device)
    s.resume(lazy=True)
    if s.state == "resuming":
        with pytest.raises(CheckpointError, match="still running"):
            s.resume()
    s.wait()
    assert s.state == "resumed"


def test_a_suspend_during_a_lazy_resume_waits_for_it(device: torch.device) -> None:
    model = _model(device)
    x = torch.randn(2, 32, device=device)
    with torch.no_grad():
        expected = model(x)
    s = suspend({"model": model}, device=device)
    s.resume(lazy=True)
    again = suspend({"model": model}, device=device)  # after the copies: never a half-resumed storage
    assert s.state == "resumed" and again.stats.bytes == s.stats.bytes
    again.resume(lazy=True)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    again.wait()
