"""Cold start: a model built without initialisation serves its first forward while loading."""

from __future__ import annotations

import pytest
import torch
from restore_support import held_root, on_demand, tiny_config
from torch import nn

import gpusnap


class TinyLM(nn.Module):
    """Tied embeddings and a non-persistent causal mask, like GPT-2."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 4, ctx: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("mask", torch.tril(torch.ones(ctx, ctx)), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        n = ids.shape[-1]
        for block in self.blocks:
            mixed = (self.mask[:n, :n] / self.mask[:n, :n].sum(-1, keepdim=True)) @ h
            h = h + torch.tanh(block(mixed))
        return self.head(h)


def test_empty_model_keeps_ties_and_builds_buffers(device):
    model = gpusnap.empty_model(TinyLM, device)
    assert model.head.weight is model.emb.weight
    assert all(p.device.type == device.type and not p.is_meta for p in model.parameters())
    assert torch.equal(model.mask.cpu(), torch.tril(torch.ones(16, 16))), "non-persistent buffer computed"
    assert all(p.requires_grad for p in model.parameters())
    assert nn.Module.register_parameter.__qualname__ == "Module.register_parameter", "patch undone"


def test_empty_model_undoes_its_patch_on_error():
    def broken() -> nn.Module:
        nn.Linear(2, 2)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        gpusnap.empty_model(broken, "cpu")
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_cold_start_serves_before_everything_is_loaded(tmp_path, monkeypatch, device):
    """Deterministic: the loader loads only what the forward waits for (``on_demand``) until
    ``handle.wait()``, so that forward is served while nothing, then not everything, is loaded."""
    torch.manual_seed(0)
    trained = TinyLM(layers=12).to(device)
    ids = torch.randint(0, 64, (2, 8), device=device)
    with torch.no_grad():
        expected = trained(ids)
    with (
        held_root(tmp_path / "ck", monkeypatch) as backend,
        gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck,
    ):
        ck.save({"model": trained, "served": 0}, blocking=True)
        demand = on_demand(monkeypatch)
        state = {"served": -1}
        model, handle = gpusnap.cold_start(lambda: TinyLM(layers=12), ck, device=device, app_state=state)
        assert state == {"served": 0, "model": model}
        assert not backend.chunk_reads, "cold_start returned before any chunk was read"
        with torch.no_grad():
            out = model(ids)
        assert demand.waited, "the forward waited for what it read"
        handle.wait()
    assert torch.equal(out, expected)
    assert handle.stats["waits"] >= 1
    first = handle.stats["first_needed"]["model/emb.weight"]
    assert handle.stats["return_s"] <= first < handle.stats["total_s"], "served while loading"
    assert model.head.weight is model.emb.weight


def test_plain_meta_to_empty_recipe(tmp_path):
    torch.manual_seed(0)
    trained = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 8)
    with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        ck.save({"model": trained}, blocking=True)
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        model.to_empty(device="cpu")
        handle = ck.restore({"model": model}, lazy=True)
        out = model(x)
        handle.wait()
    assert torch.equal(out, trained(x))


def test_cold_start_warm_up_runs_beside_the_restore_without_waiting_for_weights(tmp_path, monkeypatch, device):
    """The warm-up runs on its own thread, without autograd, and reads the model before any
    chunk is read (``on_demand``: nothing loads until the program waits for it); the served
    forward is still exact."""
    import threading

    torch.manual_seed(0)
    trained = TinyLM(layers=6).to(device)
    ids = torch.randint(0, 64, (2, 8), device=device)
    with torch.no_grad():
        expected = trained(ids)
    seen: dict[str, object] = {}
    finished = threading.Event()

    def warm_up(model: nn.Module) -> None:
        seen["thread"] = threading.current_thread().name
        seen["grad"] = torch.is_grad_enabled()
        seen["shape"] = tuple(model(ids).shape)
        seen["reads"] = len(backend.chunk_reads)
        finished.set()

    with (
        held_root(tmp_path / "ck", monkeypatch) as backend,
        gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck,
    ):
        ck.save({"model": trained}, blocking=True)
        on_demand(monkeypatch)
        model, handle = gpusnap.cold_start(lambda: TinyLM(layers=6), ck, device=device, warm_up=warm_up)
        assert finished.wait(30), "the warm-up ran without waiting for any weight"
        with torch.no_grad():
            out = model(ids)
        handle.wait()
    assert seen == {"thread": "gpusnap-warm-up", "grad": False, "shape": (2, 8, 64), "reads": 0}
    assert handle.stats["warm_up"] == "ok" and handle.stats["warm_up_s"] >= 0
    assert torch.equal(out, expected)


def test_a_failing_cold_start_warm_up_is_reported_and_the_restore_stands(tmp_path, caplog):
    torch.manual_seed(0)
    trained = TinyLM()
    ids = torch.randint(0, 64, (2, 8))
    with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        ck.save({"model": trained}, blocking=True)

        def warm_up(model: nn.Module) -> None:
            raise ValueError("no such input")

        with caplog.at_level("WARNING", logger="gpusnap"):
            model, handle = gpusnap.cold_start(TinyLM, ck, device="cpu", warm_up=warm_up)
            handle.wait()
            with torch.no_grad():
                out = model(ids)
            _join_thread("gpusnap-warm-up")  # (it publishes its outcome as it ends)
    assert handle.stats["warm_up"] == "ValueError: no such input"
    assert "cold_start's warm_up failed" in caplog.text
    with torch.no_grad():
        assert torch.equal(out, trained(ids))


def test_a_call_from_another_thread_waits_for_the_running_warm_up(tmp_path):
    """The first request does not race the warm-up (both would pay the set-up): it starts
    once the warm-up has ended, and later calls do not wait."""
    import threading

    torch.manual_seed(0)
    trained = TinyLM()
    ids = torch.randint(0, 64, (2, 8))
    release, reached = threading.Event(), threading.Event()
    order: list[str] = []

    def warm_up(model: nn.Module) -> None:
        model(ids)
        release.wait()
        order.append("warm-up ended")

    def note_request(module: nn.Module, args: object) -> None:  # (global hooks run before the module's)
        if threading.current_thread().name == "request" and module is model:
            order.append("request reached the model")
            reached.set()

    outs: list[torch.Tensor] = []

    def request() -> None:
        with torch.no_grad():
            outs.append(model(ids))
        order.append("request done")

    with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        ck.save({"model": trained}, blocking=True)
        model, handle = gpusnap.cold_start(TinyLM, ck, device="cpu", warm_up=warm_up)
        handle.wait()
        hook = nn.modules.module.register_module_forward_pre_hook(note_request)
        try:
            t = threading.Thread(target=request, name="request")
            t.start()
            assert reached.wait(30)
            release.set()  # only now may the warm-up end, and the request go on
            t.join()
        finally:
            hook.remove()
        _join_thread("gpusnap-warm-up")
    assert order == ["request reached the model", "warm-up ended", "request done"]
    assert handle.stats["warm_up"] == "ok" and handle.stats["warm_up_waited_s"] >= 0
    assert not model._forward_pre_hooks, "the gate is gone once the warm-up ended"
    with torch.no_grad():
        assert torch.equal(outs[0], trained(ids)) and torch.equal(model(ids), trained(ids))


def test_the_warm_up_thread_itself_is_not_held_by_the_gate(tmp_path):
    torch.manual_seed(0)
    trained = TinyLM()
    ids = torch.randint(0, 64, (2, 8))
    with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        ck.save({"model": trained}, blocking=True)
        model, handle = gpusnap.cold_start(TinyLM, ck, device="cpu", warm_up=lambda m: [m(ids) for _ in range(3)])
        handle.wait()
        _join_thread("gpusnap-warm-up")  # (three calls of its own, none waiting for itself)
    assert handle.stats["warm_up"] == "ok" and "warm_up_waited_s" not in handle.stats


def _join_thread(name: str) -> None:
    import threading

    for t in threading.enumerate():
        if t.name == name:
            t.join()
