"""``gpusnap bench --cost``: what each checkpoint costs a training job, every system side by side.

Run from the repository root of a GPU machine (no install needed)::

    PYTHONPATH=src python3 -m gpusnap bench --cost --quick --out cost-out        # < 10 min on one GPU
    PYTHONPATH=src python3 -m gpusnap bench --cost --quick --dcp --out cost-out  # + DCP async_save (slow)
    PYTHONPATH=src python3 -m gpusnap bench --cost --out cost-full               # full: N=60, every 1, 10, 100
    python -m gpusnap bench --cost --device cpu --out /tmp/c                     # CPU smoke test (tiny)

It writes ``OUT/cost.json`` (every figure and the environment) and ``OUT/cost.md`` (tables,
the short one last, also printed last). :mod:`.cost` defines the figures.

Rows (one process, one after another, on the same live program): ``pinned_writer`` (the
baseline: stop-the-world copy to pinned buffers, one writer thread writes a file and
fsyncs), ``gpusnap_default``, ``gpusnap_fast`` (the fast tier; unavailable on a gpusnap
without one), ``torch_save_thread``, and with ``--dcp`` ``dcp_async_plain`` and
``dcp_async`` (``async_save`` with a pinned ``DefaultStager``). Workloads: ``llama``
(~0.95B, bf16 autocast, fused AdamW) and ``gpt2-large``.

Two passes, so every workload's headline figures come before the throughput runs that the
time budget (``--budget-s``; 500 s with ``--quick`` on a GPU) may cut:

1. per workload and row: setup (untimed), a plain window of N steps, the first save's window
   (a fresh system), the warm saves' windows, bit-exactness (save 0 restored into a second
   instance and compared with clones taken at its consistent point; gpusnap rows also a save
   placed between ``backward()`` and ``optimizer.step()``), the fast tier's promoted save;
   teardown.
2. per workload and row: setup, one untimed save (so the figures are warm), a plain window,
   throughput with a save every N; teardown. An N not measured (``--quick``: 100) is derived
   from the warm cost where saves cannot overlap, and marked so.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from gpusnap.bench.baselines.dcp import DcpAsyncPlain, DcpAsyncSave
from gpusnap.bench.baselines.pinned_copy import empty_host_cache
from gpusnap.bench.baselines.pinned_writer import PinnedWriter
from gpusnap.bench.baselines.torch_save_thread import TorchSaveThread
from gpusnap.bench.cost import (
    Clocks,
    CostSample,
    Window,
    bracket,
    cost_window,
    plain_window,
    read_step,
)
from gpusnap.bench.cost_summary import add_ratios, summarise
from gpusnap.bench.cost_throughput import every_n
from gpusnap.bench.env import CPU_DISCLAIMER, environment, fs_type
from gpusnap.bench.gpusnap_tiers import GpusnapDefault, GpusnapDefaultSparse, GpusnapFast
from gpusnap.bench.gpusnap_variants import warm_up_process
from gpusnap.bench.system import System, Unavailable
from gpusnap.bench.verify import clone_state
from gpusnap.bench.workloads import Workload, build_workload, missing_reason, size_for

__all__ = ["COST_WORKLOADS", "CostOptions", "run_cost"]

COST_WORKLOADS = ("llama", "gpt2-large")


@dataclass
class CostOptions:
    workloads: list[str]
    device: torch.device
    quick: bool
    root: str
    fast_root: str | None = None  # the fast tier's root (default: ROOT/run-.../fast)
    size: str | None = None
    window_steps: int | None = None  # N
    saves: int | None = None  # measured saves per row: the first and warm ones
    every: list[int] | None = None  # measured throughput periods
    systems: list[str] | None = None
    dcp: bool = False
    batch: int | None = None
    seq: int | None = None
    budget_s: float | None = None
    command: str | None = None
    log: Any = print
    clocks: Clocks = field(default_factory=Clocks)

    def resolved(self) -> CostOptions:
        cpu = self.device.type == "cpu"
        self.size = self.size or size_for(self.device, self.quick)
        if self.window_steps is None:
            self.window_steps = 3 if cpu else (30 if self.quick else 60)
        if self.saves is None:
            self.saves = 2 if (cpu or self.quick) else 3
        if self.every is None:
            self.every = [1, 10] if (cpu or self.quick) else [1, 10, 100]
        if self.budget_s is None and self.quick and not cpu:
            self.budget_s = 500.0  # the report still written within one 10-minute command
        return self

    @property
    def preset(self) -> str:
        return "cpu" if self.device.type == "cpu" else ("quick" if self.quick else "full")


# Steps of an every-N run (several saves, every-1 bounded) and its time cap, per preset.
# Every 10 spans 110 steps on a GPU: the fast tier's row promotes every 10th save, so its run
# holds a promotion (the "a save every 10 steps, promoted every 100").
_RUN_STEPS = {"cpu": {1: 2, 10: 10, 100: 100}, "quick": {1: 4, 10: 110, 100: 100}, "full": {1: 5, 10: 210, 100: 200}}
_RUN_CAP_S = {"cpu": 60.0, "quick": 40.0, "full": 240.0}
_WINDOW_CAP_S = {"cpu": 120.0, "quick": 120.0, "full": 600.0}
_GAP_STEPS = 2  # untimed steps before each measured save: the previous one's tail settles


def run_steps(n: int, preset: str) -> int:
    return _RUN_STEPS[preset].get(n, max(2 * n, 3))


class _Deadline:
    def __init__(self, limit_s: float | None, clocks: Clocks) -> None:
        self.limit_s, self.clocks, self.started = limit_s, clocks, clocks.wall()

    @property
    def at(self) -> float:
        return float("inf") if self.limit_s is None else self.started + self.limit_s

    def spent(self) -> bool:
        return self.clocks.wall() > self.at


def cost_systems(opts: CostOptions, workload: str) -> list[System]:
    assert opts.fast_root is not None
    root = os.path.join(opts.root, workload)
    target = "tmpfs" if fs_type(opts.root) == "tmpfs" else fs_type(opts.root)
    out: list[System] = [
        PinnedWriter(root, target=target),
        GpusnapDefault(root, target=target),
        GpusnapDefaultSparse(root, target=target),
        GpusnapFast(root, os.path.join(opts.fast_root, workload), target=target),
        TorchSaveThread(root, target=target),
    ]
    if opts.dcp:
        out += [DcpAsyncPlain(root), DcpAsyncSave(root)]
    if opts.systems:
        out = [s for s in out if s.key in opts.systems]
    return out


def run_cost(opts: CostOptions) -> dict[str, Any]:
    opts.resolved()
    clocks, deadline = opts.clocks, _Deadline(opts.budget_s, opts.clocks)
    cpu = opts.device.type == "cpu"
    run = f"run-{os.getpid()}-{int(time.time())}"
    # A directory of our own under each root: only that is deleted at the end.
    opts.root = os.path.join(opts.root, run)
    opts.fast_root = os.path.join(opts.fast_root, run) if opts.fast_root else os.path.join(opts.root, "fast")
    roots = {"root": opts.root, "fast_root": opts.fast_root}
    for path in roots.values():
        os.makedirs(path, exist_ok=True)
    results: dict[str, Any] = {
        "schema": 1, "kind": "cost", "disclaimer": CPU_DISCLAIMER if cpu else None, "command": opts.command,
        "environment": environment(opts.device, roots),
        "options": {"workloads": opts.workloads, "quick": opts.quick, "size": opts.size, "preset": opts.preset,
                    "window_steps": opts.window_steps, "saves": opts.saves, "every": opts.every,
                    "systems": opts.systems, "dcp": opts.dcp, "batch": opts.batch, "seq": opts.seq,
                    "budget_s": opts.budget_s},
        "workloads": [],
    }
    opts.log(f"gpusnap bench --cost on {opts.device} ({opts.size}); N={opts.window_steps}; checkpoints in {opts.root}")
    threads = torch.get_num_threads()
    if cpu:
        torch.set_num_threads(1)  # see runner.run_bench: tiny steps stay steady on few cores
    live: list[tuple[dict[str, Any], Workload]] = []
    try:
        results["gpusnap_warm_up_s"] = warm_up_process(opts.root, opts.device)
        for name in opts.workloads:
            entry, wl = _pass_one(name, opts, deadline)
            results["workloads"].append(entry)
            if wl is not None:
                live.append((entry, wl))
        for entry, wl in live:
            _pass_two(entry, wl, opts, deadline)
            for row in entry["systems"]:
                summarise(row, [1, 10, 100])  # what is not measured is derived where it can be
            add_ratios(entry)
    finally:
        live.clear()
        torch.set_num_threads(threads)
        for path in roots.values():
            shutil.rmtree(path, ignore_errors=True)
        _free(opts.device)
    results["elapsed_s"] = clocks.wall() - deadline.started
    return results


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        empty_host_cache()


def _short(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-12))


def _pass_one(name: str, opts: CostOptions, deadline: _Deadline) -> tuple[dict[str, Any], Workload | None]:
    reason = missing_reason(name)
    if reason is not None:
        return {"name": name, "status": f"skipped: {reason}"}, None
    if deadline.spent():
        return {"name": name, "status": "skipped: time budget (--budget-s) spent"}, None
    assert opts.size is not None and opts.window_steps is not None
    try:
        kwargs: dict[str, Any] = {"size": opts.size, "batch": opts.batch, "seq": opts.seq}
        wl = build_workload(name, opts.device, seed=0, **kwargs)
        fresh = build_workload(name, opts.device, seed=1, **kwargs)
    except Exception as exc:  # noqa: BLE001  a model that does not build here: the next workload
        opts.log(f"[{name}] failed: {type(exc).__name__}: {exc}")
        return {"name": name, "status": f"failed: {type(exc).__name__}: {exc}", "traceback": _short(exc)}, None
    for _ in range(3):
        read_step(wl)  # warm-up: kernels chosen, allocator grown
    plain = plain_window(wl, opts.window_steps, opts.clocks)
    entry: dict[str, Any] = {
        "name": name, "status": "ok", "impl": wl.impl, "config": wl.config, "state_bytes": wl.state_bytes(),
        "step_s": plain.step_wall_s, "step_cpu_s": plain.step_cpu_s, "systems": [], "checks": [],
    }
    opts.log(f"[{name}] {wl.impl}: {entry['state_bytes'] / 1e9:.2f} GB of state, step {plain.step_wall_s * 1e3:.1f} ms "
             f"({plain.step_cpu_s * 1e3:.1f} ms CPU)")
    for system in cost_systems(opts, name):
        row = _measure_row(wl, fresh, system, opts, deadline, entry)
        entry["systems"].append(row)
        opts.log(f"[{name}] {system.label}: {_brief(row)} ({deadline.clocks.wall() - deadline.started:.0f} s)")
    del fresh
    _free(opts.device)
    return entry, wl


def _brief(row: dict[str, Any]) -> str:
    if row["status"] != "ok" or not row["saves"]:
        return row["status"]
    return ", ".join(f"save {s['index']}: cost {s['cost_s']:.3f} s, CPU {s['cpu_cost_s']:.3f} s, {s['steps']} steps"
                     for s in row["saves"])


def _new_row(system: System) -> dict[str, Any]:
    return {"system": system.label, "key": system.key, "family": system.family, "target": system.target,
            "status": "ok", "saves": [], "promoted": None, "throughput": [], "notes": []}


def _measure_row(wl: Workload, fresh: Workload, system: System, opts: CostOptions, deadline: _Deadline,
                 entry: dict[str, Any]) -> dict[str, Any]:
    assert opts.window_steps is not None and opts.saves is not None
    row = _new_row(system)
    reason = system.unavailable(wl)
    if reason is not None:
        row["status"] = reason
        return row
    if deadline.spent():
        row["status"] = "skipped: time budget (--budget-s) spent"
        return row
    clocks, n = opts.clocks, opts.window_steps
    window_cap = min(_WINDOW_CAP_S[opts.preset], max(deadline.at - clocks.wall(), 1.0))
    try:
        t0 = clocks.wall()
        system.setup(wl)
        row["setup_s"] = clocks.wall() - t0
        plain = plain_window(wl, n, clocks)
        row["plain"] = dict(plain.__dict__)
        charged: list[tuple[CostSample, Window]] = []  # each save, and the plain window before it
        for i in range(opts.saves):
            if i > 0 and deadline.spent():
                row["notes"].append(f"only {i} of {opts.saves} saves: time budget spent")
                break
            for _ in range(_GAP_STEPS):
                read_step(wl)
            system.prepare_save(wl, i)
            expected = clone_state(wl) if i == 0 else None
            # each save is charged against plain steps run just before it: the step time
            # drifts by a few ms over a run (clocks, memory layout), which over a window of
            # N steps is more than the cost being measured
            before = plain_window(wl, n, clocks) if i > 0 else plain
            row.setdefault("plains", []).append(dict(before.__dict__))
            sample = cost_window(wl, system, i, n, before, nbytes=entry["state_bytes"], clocks=clocks,
                                 max_s=window_cap)
            charged.append((sample, before))
            row["saves"].append(sample.as_json())  # (one-sided until bracketed below: kept if a later save fails)
            if expected is not None:
                _check(entry, system, "save 0", system.verify(wl, fresh, i, expected))
                del expected
        # each save charged against the plain windows on both sides (the next save's before,
        # one more after the last): the step time drifts over a run (cost.py: bracket)
        # ("plains": one more than the saves, each save between its two)
        for k, (sample, before) in enumerate(charged):
            if k + 1 < len(charged):
                after = charged[k + 1][1]
            else:
                after = _settled_plain(wl, n, clocks)
                row["plains"].append(dict(after.__dict__))
            row["saves"][k] = bracket(sample, before, after).as_json()
        if isinstance(system, GpusnapFast) and not deadline.spent():
            index = opts.saves
            before = plain_window(wl, n, clocks)
            sample = cost_window(wl, system, index, n, before, nbytes=entry["state_bytes"], clocks=clocks,
                                 max_s=window_cap, save=lambda: system.promoted_save(wl, index))
            # the promotion runs on after the window: the plain window after it waits for its end
            # (run during it, the promotion would count as plain and shrink the save's figure)
            promotion = _promotion(wl, system, index, window_cap, clocks)
            row["promoted"] = bracket(sample, before, _settled_plain(wl, n, clocks)).as_json()
            row["promoted"]["promotion"] = promotion
        if getattr(system, "mid_step_check", False) and not deadline.spent():
            _check(entry, system, "between backward() and optimizer.step()",
                   _mid_step(wl, fresh, system, opts.saves + 1, window_cap, clocks))
        row["pinned_bytes"] = system.pinned_bytes()
        row["bytes_on_disk"] = system.bytes_on_disk()
        row["notes"] += system.notes()
    except Unavailable as exc:
        row["status"] = f"unavailable: {exc}"
    except Exception as exc:  # noqa: BLE001  one row's failure is a row, not the end of the run
        row["status"] = f"failed: {type(exc).__name__}: {exc}"
        row["traceback"] = _short(exc)
    finally:
        _teardown(system, row, wl.device)
    return row


def _check(entry: dict[str, Any], system: System, what: str, result: tuple[bool, str] | None) -> None:
    if result is not None:
        entry["checks"].append({"system": system.key, "save": what, "ok": result[0], "detail": result[1]})


def _mid_step(wl: Workload, fresh: Workload, system: System, index: int, max_s: float,
              clocks: Clocks) -> tuple[bool, str] | None:
    """A save between ``backward()`` and ``optimizer.step()``: the step then rewrites every
    parameter and moment while they are being captured (copy-on-write for each)."""
    box: dict[str, Any] = {}

    def hook() -> None:
        box["expected"] = clone_state(wl)  # the state the save must hold: before optimizer.step()
        handle = box["handle"] = system.save(wl, index)
        if handle.before_mutation is not None:
            handle.before_mutation()

    read_step(wl, hook)
    handle = box["handle"]
    t0 = clocks.wall()
    while not handle.is_durable() and clocks.wall() - t0 < max_s:
        read_step(wl)
    handle.wait()
    return system.verify(wl, fresh, index, box["expected"])


def _settled_plain(wl: Workload, n: int, clocks: Clocks) -> Window:
    """A plain window after ``_GAP_STEPS`` untimed steps (as before each save's own: a save's
    tail settles first)."""
    for _ in range(_GAP_STEPS):
        read_step(wl)
    return plain_window(wl, n, clocks)


def _promotion(wl: Workload, system: GpusnapFast, index: int, max_s: float, clocks: Clocks) -> dict[str, Any]:
    """Training steps (not a cost window) until the promoted save lists as durable: how long
    the promotion took from its fast-tier commit, at one step's resolution."""
    t0 = clocks.wall()
    while clocks.wall() - t0 < max_s:
        found = system.promotion(index)
        if found is not None:
            return {**found, "after_commit_s": clocks.wall() - t0}
        read_step(wl)
    return {"tier": "fast", "note": f"not listed as durable within {max_s:.0f} s of its fast-tier commit"}


def _teardown(system: System, row: dict[str, Any], device: torch.device) -> None:
    try:
        system.teardown()
    except Exception as exc:  # noqa: BLE001  a failed cleanup must not hide the row's figures
        row["notes"].append(f"teardown failed: {type(exc).__name__}: {exc}")
    _free(device)


def _pass_two(entry: dict[str, Any], wl: Workload, opts: CostOptions, deadline: _Deadline) -> None:
    """Throughput at every N for each row that measured its saves."""
    assert opts.every is not None and opts.window_steps is not None
    clocks = opts.clocks
    for system, row in zip(cost_systems(opts, entry["name"]), entry["systems"]):
        if row["status"] != "ok" or not getattr(system, "measures_throughput", False):
            continue
        if deadline.spent():
            row["notes"].append(f"throughput at every {', '.join(map(str, opts.every))}: skipped, time budget spent")
            continue
        try:
            system.setup(wl)
            warm = system.save(wl, 500)  # untimed: the runs below measure warm saves
            t0 = clocks.wall()
            while not warm.is_durable() and clocks.wall() - t0 < _RUN_CAP_S[opts.preset]:
                read_step(wl)
            warm.wait()
            system.settle(wl)  # (untimed: what the first save set going in the background)
            plain = plain_window(wl, max(opts.window_steps, 10), clocks)  # (CPU's N=3 is too noisy)
            row["throughput_plain"] = dict(plain.__dict__)
            for n in opts.every:
                if deadline.spent():
                    row["notes"].append(f"throughput at every {n}: skipped, time budget spent")
                    continue
                cap = min(clocks.wall() + _RUN_CAP_S[opts.preset], deadline.at)
                row["throughput"].append(every_n(wl, system, n, run_steps(n, opts.preset), plain,
                                                 clocks=clocks, deadline=cap))
        except Exception as exc:  # noqa: BLE001  the save figures stand without the throughput
            row["notes"].append(f"throughput failed: {type(exc).__name__}: {exc}")
            row["throughput_traceback"] = _short(exc)
        finally:
            _teardown(system, row, wl.device)
