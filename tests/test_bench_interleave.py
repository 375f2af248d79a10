"""benchmarks/concurrent_stall.py --interleave: every config saves once per round, the first
config rotating, so that an A/B of configs is not biased by which one runs first."""

from __future__ import annotations

import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from bench_support import load_benchmark

import gpusnap


@pytest.fixture()
def bench() -> Any:
    return load_benchmark("concurrent_stall")


class _Ck:
    def wait(self) -> None:
        pass


def test_interleaved_saves_rotate_the_first_config(bench: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[tuple[str, str]] = []

    def fake_save(loop: Any, ck: Any, app: Any, where: str, tag: str, every: int, plain_peak: int,
                  profile: bool = False, full: Any = None) -> dict[str, Any]:
        key = next(k for k, c in cks.items() if c is ck)
        order.append((key, tag))
        return {"info": f"{key}:{tag}", "exact": True, "step_s": 1.5, "interval_s": 10.0}

    monkeypatch.setattr(bench, "one_save", fake_save)
    cks = {"a": _Ck(), "b": _Ck(), "c": _Ck()}
    out = bench.interleaved_phases(None, cks, {}, "after", 4, 5, 1.0, 0)
    assert [k for k, _ in order] == list("abc" "bca" "cab" "abc")
    assert [t for _, t in order] == ["after0"] * 3 + ["after1"] * 3 + ["after2"] * 3 + ["after3"] * 3
    for key in "abc":  # each config's own saves, in its order, with stalls against the rest median
        assert out[key]["infos"] == [f"{key}:after{s}" for s in range(4)]
        assert out[key]["stalls"] == [0.5] * 4
        assert [r["interval_stall"] for r in out[key]["rows"]] == [5.0] * 4


def test_parse_variant_numbers_repeated_configs(bench: Any) -> None:
    key, cfg, switches = bench.parse_variant("device_snapshot=0,_gather=0", [])
    assert key == "device_snapshot=0,_gather=0" and cfg.device_snapshot is False and switches == {"_gather": 0}
    assert bench.parse_variant("validate=0", ["validate=0"])[0] == "validate=0 #2"
    assert bench.parse_variant("", [])[0] == "gpusnap"


class _TinyLM(torch.nn.Module):
    """What the bench's loop calls: ``model(data, labels=data).loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 8)
        self.head = torch.nn.Linear(8, 32)

    def forward(self, data: torch.Tensor, labels: torch.Tensor) -> Any:
        logits = self.head(self.emb(data))
        return types.SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def _loop(bench: Any, pipelined: bool) -> Any:
    torch.manual_seed(0)
    model = _TinyLM()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, 32, (2, 6))
    loop = bench.Loop(model, optim, data, torch.device("cpu"), pipelined=pipelined)
    loop.steps(2)  # AdamW's state exists from here on
    return loop


class _Clock:
    """A virtual clock for the bench's module: only ``sleep`` moves it, so the step's own work
    takes no time at all, however loaded the machine."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_pipelined_step_leaves_out_the_excluded_work(bench: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    loop = _loop(bench, pipelined=True)
    clock = _Clock()
    monkeypatch.setattr(bench, "time", clock)
    span = loop.step(hook=lambda: loop.exclude(lambda: clock.sleep(0.3)))
    assert isinstance(span, bench.EventSpan)
    assert loop.host_s == pytest.approx(0.3)  # the host spent it inside the step...
    assert float(span) == pytest.approx(0.0)  # ...and the step's time leaves it out


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("where", ["after", "cow"])
def test_one_save_checks_each_save_against_the_consistent_point(
        bench: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pipelined: bool, where: str) -> None:
    loop = _loop(bench, pipelined)
    def build(name: str, dev: Any, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = _TinyLM()
        return model, torch.optim.AdamW(model.parameters())

    monkeypatch.setattr(bench, "build", build)
    monkeypatch.setitem(bench._TARGET, "name", "tiny")
    monkeypatch.delitem(bench._TARGET, "app", raising=False)
    app = {"model": loop.model, "optim": loop.optim, "step": 0}
    with gpusnap.Checkpointer(tmp_path / "ck", keep_last=2) as ck:
        rows = [bench.one_save(loop, ck, app, where, f"{where}{s}", 3, 0) for s in range(2)]
        # a wrong expectation is caught: the check compares bytes, it does not just succeed
        wrong = [t.clone() for t in loop.expected_out()]
        wrong[0][0] ^= 1
        assert not bench.verify(ck, loop, rows[1]["info"], wrong)
    assert all(r["exact"] for r in rows)
    assert rows[0]["info"].id != rows[1]["info"].id
    assert all(r["interval_s"] >= r["step_s"] > 0 for r in rows)


def test_save_on_device_reports_where_a_synchronizing_call_came_from(bench: Any) -> None:
    loop = _loop(bench, pipelined=True)

    def syncing_save() -> str:
        warnings.warn("called a synchronizing CUDA operation")  # as torch's sync debug mode words it
        warnings.warn("something else")
        return "pending"

    out = bench.save_on_device(loop, syncing_save)
    assert out["pending"] == "pending" and out["syncs"] == 1
    assert "syncing_save" in out["sync_stacks"][0]  # the caller's frame, not torch's
