"""``gpusnap bench --cost``: its windows on a virtual clock, and its report end to end on CPU.

Every asserted number comes from fakes driven by a virtual wall clock and a virtual CPU
clock (:class:`Clocks` is injected), so no figure depends on the machine; the CPU run checks
the report's structure and that each figure is taken from the right window.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gpusnap.bench import gpusnap_tiers
from gpusnap.bench.cost import (
    Clocks,
    CostSample,
    Window,
    bracket,
    cost_window,
    plain_window,
)
from gpusnap.bench.cost_runner import (
    CostOptions,
    _Deadline,
    _measure_row,
    _mid_step,
    run_cost,
)
from gpusnap.bench.cost_summary import add_ratios, summarise
from gpusnap.bench.cost_throughput import derived, every_n
from gpusnap.bench.env import CPU_DISCLAIMER
from gpusnap.bench.system import SaveHandle, System
from gpusnap.bench.workloads import Workload, build_workload
from gpusnap.cli.main import main

STEP, STEP_CPU = 1.0, 0.5  # a plain step: wall and CPU seconds
CALL, CALL_CPU = 0.3, 0.2  # save() itself
EXTRA, EXTRA_CPU = 0.05, 0.02  # what each step pays while the save is not yet durable


class _Clock:
    def __init__(self) -> None:
        self.wall_now, self.cpu_now = 100.0, 10.0

    def spend(self, wall: float, cpu: float) -> None:
        self.wall_now += wall
        self.cpu_now += cpu

    def clocks(self) -> Clocks:
        return Clocks(wall=lambda: self.wall_now, cpu=lambda: self.cpu_now)


class _Loss:
    """Stands for a loss tensor: counts how often the loop reads it on the host."""

    def __init__(self, reads: list[int]) -> None:
        self.reads = reads

    def reshape(self, *_: Any) -> _Loss:
        return self

    def __getitem__(self, _: Any) -> _Loss:
        return self

    def item(self) -> float:
        self.reads[0] += 1
        return 1.0


class _Fake:
    """A workload whose steps cost STEP (+ EXTRA while a save is busy), and a system whose save
    costs CALL and becomes durable ``durable_after`` steps after save()."""

    def __init__(self, clock: _Clock, durable_after: int) -> None:
        self.clock, self.durable_after = clock, durable_after
        self.steps = 0
        self.reads = [0]
        self.busy_until: int | None = None
        self.waits: list[int] = []  # the step count at each wait()

    def workload(self) -> Workload:
        def step(hook: Any = None) -> Any:
            if hook is not None:
                hook()
            busy = self.busy_until is not None and self.steps < self.busy_until
            self.clock.spend(STEP + (EXTRA if busy else 0.0), STEP_CPU + (EXTRA_CPU if busy else 0.0))
            self.steps += 1
            return _Loss(self.reads)

        return Workload("fake", "training", torch.device("cpu"), {"model": torch.nn.Linear(1, 1)}, step, "fake")

    def system(self) -> System:
        fake = self

        class _Sys(System):
            measures_throughput = True

            def prepare_save(self, wl: Workload, index: int) -> None:
                fake.clock.spend(7.0, 3.0)  # rotation: must not be charged to the throughput run

            def save(self, wl: Workload, index: int) -> SaveHandle:
                started = fake.clock.wall_now
                fake.clock.spend(CALL, CALL_CPU)
                fake.busy_until = fake.steps + fake.durable_after
                until = fake.busy_until
                return SaveHandle(started=started, returned=fake.clock.wall_now, is_captured=lambda: True,
                                  is_durable=lambda: fake.steps >= until, wait=lambda: fake.waits.append(fake.steps) or {})

        return _Sys()


def test_plain_window_times_n_steps_on_both_clocks_and_reads_each_loss() -> None:
    clock = _Clock()
    fake = _Fake(clock, durable_after=0)
    plain = plain_window(fake.workload(), 4, clock.clocks())
    assert plain == Window(4, pytest.approx(4 * STEP), pytest.approx(4 * STEP_CPU))
    assert fake.reads == [4]


def test_a_save_longer_than_n_steps_extends_the_window_and_is_charged_that_many_plain_steps() -> None:
    clock = _Clock()
    fake = _Fake(clock, durable_after=6)
    plain = Window(4, 4 * STEP, 4 * STEP_CPU)
    s = cost_window(fake.workload(), fake.system(), 0, 4, plain, nbytes=66 * 10**8, clocks=clock.clocks())
    assert s.steps == 6  # N = 4, but durable only after the 6th step
    assert s.wall_s == pytest.approx(CALL + 6 * (STEP + EXTRA))
    assert s.cost_s == pytest.approx(CALL + 6 * EXTRA)  # minus 6 plain steps, not 4
    assert s.cpu_s == pytest.approx(CALL_CPU + 6 * (STEP_CPU + EXTRA_CPU))
    assert s.cpu_cost_s == pytest.approx(CALL_CPU + 6 * EXTRA_CPU)
    assert s.call_s == pytest.approx(CALL)
    assert s.stall_s == pytest.approx(CALL + EXTRA)  # the step containing the save only
    assert s.durable_s == pytest.approx(CALL + 6 * (STEP + EXTRA))  # seen at the end of step 6
    assert s.durable_GBps == pytest.approx(6.6 / s.durable_s)
    assert fake.waits == [6] and fake.reads == [6]  # wait() once, when first seen durable
    assert s.note is None


def test_a_save_durable_early_still_spans_n_steps() -> None:
    clock = _Clock()
    fake = _Fake(clock, durable_after=1)
    plain = Window(4, 4 * STEP, 4 * STEP_CPU)
    s = cost_window(fake.workload(), fake.system(), 0, 4, plain, nbytes=1, clocks=clock.clocks())
    assert s.steps == 4
    assert s.cost_s == pytest.approx(CALL + EXTRA)
    assert s.cpu_cost_s == pytest.approx(CALL_CPU + EXTRA_CPU)
    assert s.step_s == pytest.approx([CALL + STEP + EXTRA, STEP, STEP, STEP])
    assert fake.waits == [1]


def test_the_systems_own_durable_moment_is_preferred_to_the_step_that_saw_it() -> None:
    clock = _Clock()
    fake = _Fake(clock, durable_after=2)
    system = fake.system()
    inner = system.save

    def save(wl: Workload, index: int) -> SaveHandle:
        handle = inner(wl, index)
        handle.durable_at = handle.started + 1.5  # as gpusnap's duration_s or a writer thread says
        return handle

    system.save = save  # type: ignore[method-assign]
    s = cost_window(fake.workload(), system, 0, 2, Window(2, 2.0, 1.0), nbytes=3 * 10**9, clocks=clock.clocks())
    assert s.durable_s == pytest.approx(1.5) and s.durable_GBps == pytest.approx(2.0)


def test_a_window_that_runs_out_says_so_and_waits_after_it() -> None:
    clock = _Clock()
    fake = _Fake(clock, durable_after=50)
    s = cost_window(fake.workload(), fake.system(), 0, 2, Window(2, 2.0, 1.0), nbytes=1, clocks=clock.clocks(),
                    max_steps=5)
    assert s.steps == 5 and s.note is not None and "not durable" in s.note
    assert fake.waits == [5]


def test_a_save_is_charged_against_the_plain_windows_on_both_sides() -> None:
    # the plain step drifts from 1.0 s (before) to 1.2 s (after); the save's 6 steps ran at 1.1 s
    before, after = Window(4, 4.0, 2.0), Window(4, 4.8, 2.4)
    wall = CALL + 6 * 1.1
    one_sided = CostSample(index=1, steps=6, wall_s=wall, cpu_s=3.3, cost_s=wall - 6 * 1.0, cpu_cost_s=0.3,
                           call_s=CALL, stall_s=CALL + 1.1 - 1.0, durable_s=1.0, durable_GBps=1.0, nbytes=1)
    s = bracket(one_sided, before, after)
    assert s.cost_s == pytest.approx(CALL)  # not the 0.9 s the window before alone would say
    assert s.cost_before_only_s == pytest.approx(CALL + 0.6)
    assert s.drift_s == pytest.approx(6 * 0.2)
    assert s.cpu_cost_s == pytest.approx(3.3 - 6 * 0.55)
    assert s.stall_s == pytest.approx(CALL)  # the first step against the mean plain step


def test_the_runner_brackets_every_save_by_the_next_saves_plain_window(tmp_path: Path) -> None:
    clock = _Clock()
    fake = _Fake(clock, durable_after=2)
    wl = fake.workload()
    opts = CostOptions(workloads=["fake"], device=torch.device("cpu"), quick=False, root=str(tmp_path),
                       window_steps=4, saves=3, every=[], clocks=clock.clocks()).resolved()
    row = _measure_row(wl, wl, fake.system(), opts, _Deadline(None, opts.clocks), {"state_bytes": 1, "checks": []})
    assert row["status"] == "ok", row
    assert [s["index"] for s in row["saves"]] == [0, 1, 2]
    for s in row["saves"]:  # steady plain steps: both sides agree, no drift
        assert s["drift_s"] == pytest.approx(0.0)
        assert s["cost_s"] == pytest.approx(CALL + 2 * EXTRA) == s["cost_before_only_s"]


def test_a_drifting_step_is_cancelled_by_the_windows_on_both_sides(tmp_path: Path) -> None:
    clock = _Clock()
    fake = _Fake(clock, durable_after=2)
    drift = 0.01  # each step 10 ms slower than the one before it
    inner = fake.workload().step

    def step(hook: Any = None) -> Any:
        clock.spend(drift * fake.steps, 0.0)
        return inner(hook)

    wl = fake.workload()
    wl.step = step
    opts = CostOptions(workloads=["fake"], device=torch.device("cpu"), quick=False, root=str(tmp_path),
                       window_steps=4, saves=3, every=[], clocks=clock.clocks()).resolved()
    row = _measure_row(wl, wl, fake.system(), opts, _Deadline(None, opts.clocks), {"state_bytes": 1, "checks": []})
    true = CALL + 2 * EXTRA  # what each save adds to its steps, whatever the plain step is then
    for s in row["saves"]:
        assert s["drift_s"] > 0  # the plain step after is slower than the one before
        bracketed, one_sided = abs(s["cost_s"] - true), abs(s["cost_before_only_s"] - true)
        assert bracketed < one_sided / 2, (s["cost_s"], s["cost_before_only_s"])
        assert bracketed <= 4 * 4 * drift


def test_a_failing_later_save_keeps_the_earlier_saves_figures(tmp_path: Path) -> None:
    clock = _Clock()
    fake = _Fake(clock, durable_after=1)
    system = fake.system()
    real = system.save

    def save(wl: Workload, index: int) -> SaveHandle:
        if index == 2:
            raise RuntimeError("the third save failed")
        return real(wl, index)

    system.save = save  # type: ignore[method-assign]
    wl = fake.workload()
    opts = CostOptions(workloads=["fake"], device=torch.device("cpu"), quick=False, root=str(tmp_path),
                       window_steps=4, saves=3, every=[], clocks=clock.clocks()).resolved()
    row = _measure_row(wl, wl, system, opts, _Deadline(None, opts.clocks), {"state_bytes": 1, "checks": []})
    assert "the third save failed" in row["status"]
    assert [s["index"] for s in row["saves"]] == [0, 1]  # measured before the failure: still reported


def test_every_n_counts_whole_periods_and_leaves_rotation_out() -> None:
    clock = _Clock()
    fake = _Fake(clock, durable_after=0)
    plain = Window(10, 10 * STEP, 10 * STEP_CPU)
    t = every_n(fake.workload(), fake.system(), 10, 20, plain, clocks=clock.clocks(), deadline=float("inf"))
    assert (t["steps"], t["saves"], t["cut_by_time"]) == (20, 2, False)
    assert t["wall_s"] == pytest.approx(20 * STEP + 2 * CALL)  # prepare_save's 7 s each: not charged
    assert t["loss"] == pytest.approx(1 - (20 / (20 * STEP + 2 * CALL)) / (1 / STEP))
    assert t["cpu_per_save_s"] == pytest.approx(CALL_CPU)


def test_every_n_past_its_deadline_stops_at_a_period_boundary() -> None:
    clock = _Clock()
    fake = _Fake(clock, durable_after=0)
    plain = Window(10, 10 * STEP, 10 * STEP_CPU)
    t = every_n(fake.workload(), fake.system(), 10, 30, plain, clocks=clock.clocks(), deadline=clock.wall_now + 5)
    assert (t["steps"], t["saves"], t["cut_by_time"]) == (10, 1, True)


def test_derived_loss_only_where_saves_cannot_overlap() -> None:
    plain = Window(10, 10.0, 5.0)
    assert derived(10, 1.0, 5.0, plain)["loss"] == pytest.approx(1.0 / 11.0)
    assert derived(1, 1.0, 5.0, plain) is None  # a save lasting 5 steps, one every step: not derivable


def _row(key: str, costs: list[float], gbps: list[float]) -> dict[str, Any]:
    saves = [{"cost_s": c, "cpu_cost_s": c / 2, "durable_s": 1.5, "durable_GBps": g, "stall_s": 0.01,
              "call_s": 0.001, "stats": {}} for c, g in zip(costs, gbps)]
    return {"key": key, "status": "ok", "saves": saves, "throughput": [], "notes": [],
            "plain": {"steps": 10, "wall_s": 10.0, "cpu_s": 5.0}}


def test_first_and_warm_figures_and_ratios_to_the_pinned_writer() -> None:
    base = _row("pinned_writer", [0.9, 0.5, 0.7], [2.0, 4.0, 4.0])
    mine = _row("gpusnap_default", [3.0, 0.1, 0.3], [1.0, 8.0, 8.0])
    entry = {"systems": [base, mine]}
    for row in entry["systems"]:
        summarise(row, [1, 10, 100])
    add_ratios(entry)
    assert mine["first"]["cost_s"] == 3.0 and mine["warm"]["cost_s"] == pytest.approx(0.2)  # median of warm
    assert mine["vs_baseline"]["cost"] == pytest.approx(0.2 / 0.6)
    assert mine["vs_baseline"]["cpu"] == pytest.approx(0.1 / 0.3)
    assert mine["vs_baseline"]["durable_GBps"] == pytest.approx(2.0)
    assert [t["every"] for t in mine["throughput"]] == [10, 100]  # N=1: a 1.5 s save outlasts a 1 s step
    assert mine["promotion_cpu_s"] is None  # no promotion_cpu_s reported: None, not 0


def test_fast_row_is_unavailable_without_a_fast_tier(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    class OldCheckpointer:
        def __init__(self, root: str, *, keep_last: int | None = None) -> None: ...

    monkeypatch.setattr(gpusnap_tiers.gpusnap, "Checkpointer", OldCheckpointer)
    assert not gpusnap_tiers.has_fast_tier()
    wl = build_workload("llama", torch.device("cpu"), size="tiny")
    system = gpusnap_tiers.GpusnapFast(str(tmp_path), str(tmp_path / "fast"))
    opts = CostOptions(workloads=["llama"], device=torch.device("cpu"), quick=False, root=str(tmp_path)).resolved()
    from gpusnap.bench.cost_runner import _Deadline

    row = _measure_row(wl, wl, system, opts, _Deadline(None, opts.clocks), {"state_bytes": 1, "checks": []})
    assert row["status"] == gpusnap_tiers.NO_FAST_TIER == "unavailable: this gpusnap has no fast tier"


def test_mid_step_save_lands_between_backward_and_optimizer_step(tmp_path: Path) -> None:
    from gpusnap.bench.baselines.pinned_writer import PinnedWriter

    wl = build_workload("llama", torch.device("cpu"), size="tiny", seed=0)
    fresh = build_workload("llama", torch.device("cpu"), size="tiny", seed=1)
    system = PinnedWriter(str(tmp_path))
    grads_at_save: list[bool] = []
    inner = system.save

    def save(w: Workload, index: int) -> SaveHandle:
        grads_at_save.append(all(p.grad is not None for p in w.app_state["model"].parameters()))
        return inner(w, index)

    system.save = save  # type: ignore[method-assign]
    system.setup(wl)
    try:
        ok, detail = _mid_step(wl, fresh, system, 0, 60.0, Clocks())
    finally:
        system.teardown()
    assert grads_at_save == [True]  # backward() done, optimizer.step() not yet (it zeroes them after)
    assert ok, detail


def test_a_spent_budget_skips_instead_of_measuring(tmp_path: Path) -> None:
    opts = CostOptions(workloads=["llama"], device=torch.device("cpu"), quick=True, root=str(tmp_path), budget_s=0.0,
                       log=lambda *_: None)
    results = run_cost(opts)
    assert results["workloads"] == [{"name": "llama", "status": "skipped: time budget (--budget-s) spent"}]


@pytest.mark.memory_tier  # (the default rows as a user gets them)
def test_cost_suite_end_to_end_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = main(["bench", "--cost", "--device", "cpu", "--workload", "llama", "--out", str(out),
                 "--root", str(tmp_path / "root")])
    assert code == 0
    results = json.loads((out / "cost.json").read_text())
    md = (out / "cost.md").read_text()
    assert results["kind"] == "cost" and results["disclaimer"] == CPU_DISCLAIMER
    (wl,) = results["workloads"]
    assert wl["name"] == "llama" and wl["status"] == "ok" and wl["config"]["num_key_value_heads"] == 2
    keys = [r["key"] for r in wl["systems"]]
    assert keys == ["pinned_writer", "gpusnap_default", "gpusnap_default_p10", "gpusnap_fast", "torch_save_thread"]
    n = results["options"]["window_steps"]
    for row in wl["systems"]:
        if row["key"] == "gpusnap_fast" and not gpusnap_tiers.has_fast_tier():
            assert row["status"] == gpusnap_tiers.NO_FAST_TIER
            continue
        assert row["status"] == "ok", (row["key"], row["status"], row.get("traceback"))
        plain = Window(row["plain"]["steps"], row["plain"]["wall_s"], row["plain"]["cpu_s"])
        assert plain.steps == n
        assert len(row["saves"]) == 2 and len(row["plains"]) == 3  # each save between two plain windows
        assert row["plains"][0] == row["plain"]  # later saves: a plain window of their own
        for s, before, after in zip(row["saves"], row["plains"], row["plains"][1:]):
            plain = Window(before["steps"] + after["steps"], before["wall_s"] + after["wall_s"],
                           before["cpu_s"] + after["cpu_s"])
            assert before["steps"] == after["steps"] == n
            assert s["steps"] >= n and len(s["step_s"]) == s["steps"]
            # each figure from its own window: the save's, less as many plain steps as the mean
            # of the plain windows run just before and just after it
            assert s["cost_s"] == pytest.approx(s["wall_s"] - s["steps"] * plain.step_wall_s)
            assert s["cpu_cost_s"] == pytest.approx(s["cpu_s"] - s["steps"] * plain.step_cpu_s)
            assert s["cost_before_only_s"] == pytest.approx(s["wall_s"] - s["steps"] * before["wall_s"] / n)
            assert s["durable_s"] > 0 and s["durable_GBps"] > 0
        assert row["first"]["cost_s"] == row["saves"][0]["cost_s"]
        assert row["warm"]["cost_s"] == row["saves"][1]["cost_s"]
        measured = [t["every"] for t in row["throughput"] if t["how"] == "measured"]
        assert measured == [1, 10]
        if row["key"] != "pinned_writer":
            assert set(row["vs_baseline"]) == {"cost", "cpu", "durable_GBps"}
        checks = {c["save"] for c in wl["checks"] if c["system"] == row["key"]}
        want = {"save 0", "between backward() and optimizer.step()"} if row["family"] == "gpusnap" else {"save 0"}
        assert checks == want
    assert all(c["ok"] for c in wl["checks"]), wl["checks"]
    assert CPU_DISCLAIMER in md
    last = md.strip().split("\n## ")[-1]
    assert last.startswith("Summary: what a checkpoint costs")  # the short table comes last
    assert "| llama | pinned copy + writer thread |" in last and "| llama | gpusnap default |" in last
    assert not list((tmp_path / "root").glob("run-*")), "checkpoint roots must be cleaned up"
