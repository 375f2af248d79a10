"""``ckpt.restore(app_state, strict=False)``: only the keys both sides have (DESIGN.md, "Interop").

A model alone from a training checkpoint, bit for bit, with nothing of the optimizer read
(eager in every verify mode, lazy, from a fast tier root); module entries and nested dict
keys on one side only reported by dotted path, as torch's ``load_state_dict(strict=False)``
reports them; shape mismatches on shared keys and ``strict=True`` still refused before any
byte moves.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from fast_support import CFG, roots, same, snapshot
from restore_support import tiny_config
from torch import nn

import gpusnap
from gpusnap.kernels.chunk_hash import chunk_hashes, hashes_to_hex
from gpusnap.kernels.hashing import chunk_digest
from gpusnap.storage.repository import Repository


def _model(seed: int, out: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, out))


def _training_state() -> dict[str, Any]:
    """A model, its AdamW optimizer after one step (it has state) and a step counter."""
    model = _model(0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 16)).square().sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "step": 1}


def _digests(tensors: Iterable[torch.Tensor], chunk_size: int, *, fast: bool) -> set[str]:
    """The chunk digests a save of these (contiguous, one storage each) tensors stores: BLAKE2b,
    or (``fast``: a fast tier names chunks by it) the device hash."""
    found: set[str] = set()
    for t in tensors:
        data = t.detach().reshape(-1).view(torch.uint8)
        if fast:
            found |= set(hashes_to_hex(chunk_hashes(data, chunk_size)))
        else:
            raw = data.numpy().tobytes()
            found |= {chunk_digest(raw[k : k + chunk_size]) for k in range(0, len(raw), chunk_size)}
    return found


def _optimizer_tensors(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for per in optim.state_dict()["state"].values() for v in per.values() if isinstance(v, torch.Tensor)]


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every chunk digest any restore path reads (on CPU all of them go through read_chunks_into)."""
    seen: list[str] = []
    original = Repository.read_chunks_into

    def counting(self: Repository, digests: Any, *args: Any, **kwargs: Any) -> Any:
        seen.extend(d.split("@")[0] for d in digests)  # (a fast tier's chunk names: digest@location)
        return original(self, digests, *args, **kwargs)

    monkeypatch.setattr(Repository, "read_chunks_into", counting)
    return seen


def _check_model_alone(ck: gpusnap.Checkpointer, state: dict[str, Any], reads: list[str], *, fast: bool = False,
                       **kwargs: Any) -> gpusnap.RestoreHandle:
    expected = {k: v for k, v in snapshot(state).items() if k.startswith("model/")}
    chunk_size = ck.config.chunk_size
    model_chunks = _digests(state["model"].state_dict().values(), chunk_size, fast=fast)
    optim_chunks = _digests(_optimizer_tensors(state["optim"]), chunk_size, fast=fast)
    assert model_chunks and optim_chunks and not model_chunks & optim_chunks
    target = {"model": _model(1)}
    x = torch.randn(3, 16)
    handle = ck.restore(target, strict=False, **kwargs)
    assert torch.equal(target["model"](x), state["model"](x))  # lazy: the forward waits for what it touches
    handle.wait()
    assert same(snapshot(target), expected) == []
    assert handle.stats["unexpected"] == ["optim", "step"]
    assert handle.stats["missing"] == []
    assert set(reads) == model_chunks  # nothing of the optimizer
    assert handle.stats["bytes_read"] == sum(t.nbytes for t in state["model"].state_dict().values())
    return handle


@pytest.mark.parametrize(("lazy", "verify"), [(False, "upfront"), (False, "stream"), (False, "off"),
                                              (True, "stream"), (True, "off")])
def test_a_model_alone_from_a_training_checkpoint(tmp_path: Path, reads: list[str], lazy: bool,
                                                  verify: str) -> None:
    state = _training_state()
    with gpusnap.Checkpointer(tmp_path, config=tiny_config()) as ck:
        ck.save(state).wait()
        handle = _check_model_alone(ck, state, reads, lazy=lazy, verify=verify)
        assert handle.stats["mode"] == ("lazy" if lazy else "eager")


def test_a_model_alone_from_a_fast_tier_root(tmp_path: Path, reads: list[str]) -> None:
    durable, fast = roots(tmp_path)
    state = _training_state()
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        info = ck.save(state).wait()
        assert info.tier == "fast"
        _check_model_alone(ck, state, reads, fast=True)
        reads.clear()
        _check_model_alone(ck, state, reads, fast=True, lazy=True)


def test_the_default_strict_restore_still_refuses_extra_keys(tmp_path: Path, reads: list[str]) -> None:
    state = _training_state()
    target = {"model": _model(1)}
    before = snapshot(target)
    with gpusnap.Checkpointer(tmp_path, config=tiny_config()) as ck:
        ck.save(state).wait()
        with pytest.raises(gpusnap.RestoreMismatchError, match=r"keys in the checkpoint but not in app_state"):
            ck.restore(target)
        assert ck.restore(state).stats["missing"] == ck.restore(state).stats["unexpected"] == []
    assert same(snapshot(target), before) == []


class _Block(nn.Module):
    def __init__(self, buffer: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer(buffer, torch.randn(3))


class _Net(nn.Module):
    """``block.<buffer>`` differs between the saved and the restored net; ``head.weight`` is shared."""

    def __init__(self, buffer: str, *, head_bias: bool) -> None:
        super().__init__()
        self.block = _Block(buffer)
        self.head = nn.Linear(4, 2, bias=head_bias)


def _module_pair() -> tuple[dict[str, Any], dict[str, Any]]:
    """(saved, target): the target's net lacks a buffer and has another, lacks ``head.bias``;
    its ``extras`` dict has a tensor the checkpoint lacks and lacks one it has; it has an
    optimizer the checkpoint lacks entirely."""
    torch.manual_seed(0)
    saved = {"net": _Net("old", head_bias=True), "extras": {"w": torch.randn(5), "gone": torch.randn(2)}}
    torch.manual_seed(1)
    net = _Net("new", head_bias=False)
    target = {"net": net, "extras": {"w": torch.zeros(5), "added": torch.ones(2)},
              "optim": torch.optim.SGD(net.parameters(), lr=0.1)}
    return saved, target


def test_module_entries_and_nested_keys_on_one_side_are_reported_by_dotted_path(tmp_path: Path) -> None:
    saved, target = _module_pair()
    torch_report = _Net("new", head_bias=False).load_state_dict(saved["net"].state_dict(), strict=False)
    untouched = {"net.block.new": target["net"].block.new.clone(), "extras.added": target["extras"]["added"].clone()}
    with gpusnap.Checkpointer(tmp_path, config=tiny_config()) as ck:
        ck.save(saved).wait()
        handle = ck.restore(target, strict=False)
    assert handle.stats["missing"] == ["optim", "net.block.new", "extras.added"]  # in the order of the walk
    assert handle.stats["unexpected"] == ["net.block.old", "net.head.bias", "extras.gone"]
    assert [f"net.{k}" for k in torch_report.missing_keys] == handle.stats["missing"][1:2]
    assert [f"net.{k}" for k in torch_report.unexpected_keys] == handle.stats["unexpected"][:2]
    net, was = target["net"], saved["net"]
    for name in ("block.lin.weight", "block.lin.bias", "head.weight"):  # the shared keys: bit for bit
        assert torch.equal(net.get_parameter(name), was.get_parameter(name)), name
    assert torch.equal(target["extras"]["w"], saved["extras"]["w"])
    assert torch.equal(net.block.new, untouched["net.block.new"])  # the missing ones: left as they were
    assert torch.equal(target["extras"]["added"], untouched["extras.added"])


def test_strict_restore_of_the_same_pair_raises_and_writes_nothing(tmp_path: Path, reads: list[str]) -> None:
    saved, target = _module_pair()
    before = snapshot(target)
    with gpusnap.Checkpointer(tmp_path, config=tiny_config()) as ck:
        ck.save(saved).wait()
        with pytest.raises(gpusnap.RestoreMismatchError) as caught:
            ck.restore(target)
    message = str(caught.value)
    for key in ("'block.new'", "'block.old'", "'head.bias'", "'added'", "'gone'", "'optim'"):
        assert key in message, key
    assert same(snapshot(target), before) == [] and reads == []


@pytest.mark.parametrize("lazy", [False, True])
def test_a_shape_mismatch_on_a_shared_key_still_raises_before_any_byte(tmp_path: Path, reads: list[str],
                                                                      lazy: bool) -> None:
    state = _training_state()
    target = {"model": _model(1, out=4)}  # the last layer: 4 outputs, the checkpoint's has 8
    before = snapshot(target)
    with gpusnap.Checkpointer(tmp_path, config=tiny_config()) as ck:
        ck.save(state).wait()
        with pytest.raises(gpusnap.RestoreMismatchError, match=r"model/2\.weight: .*\[8, 16\].*\[4, 16\]"):
            ck.restore(target, strict=False, lazy=lazy)
    assert same(snapshot(target), before) == [] and reads == []


def test_an_optimizer_beside_a_model_whose_parameters_differ_is_refused_before_any_byte_moves(tmp_path) -> None:
    """Optimizer state follows parameters by position: a renamed parameter would get another's moments."""
    import torch
    from torch import nn

    import gpusnap

    class Two(nn.Module):
        def __init__(self, second: str) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.ones(4))
            self.register_parameter(second, nn.Parameter(torch.full((4,), 10.0)))

    saved = Two("b")
    opt = torch.optim.Adam(saved.parameters())
    (saved.a.sum() + saved.b.sum()).backward()
    opt.step()
    with gpusnap.Checkpointer(tmp_path / "ck") as ck:
        ck.save({"model": saved, "optim": opt}).wait()
        live = Two("c")
        live_opt = torch.optim.Adam(live.parameters())
        before = [p.detach().clone() for p in live.parameters()]
        with pytest.raises(gpusnap.RestoreMismatchError, match="by position"):
            ck.restore({"model": live, "optim": live_opt}, strict=False)
        assert all(torch.equal(p, q) for p, q in zip(live.parameters(), before))  # nothing written
        assert live_opt.state_dict()["state"] == {}
        h = ck.restore({"model": live}, strict=False)  # the model alone: fine
        assert h.stats["missing"] == ["model.c"] and sorted(h.stats["unexpected"]) == ["model.b", "optim"]
        assert torch.equal(live.a, saved.a)
