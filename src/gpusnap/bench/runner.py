"""Runs the suite: for each workload, every system in turn in the same process, then the report.

Per workload: build it (and a second instance, the restore target), time plain steps, then
for each system: setup, ``saves`` measured saves (the first of gpusnap's rows restored into
the second instance and compared bit for bit with clones taken at its consistent point),
throughput at every N, restore, teardown. Systems run one after another, never together,
so each one's figures are its own; a failing system is a row with its error, not a crash.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

import gpusnap
from gpusnap.bench.baselines.cuda_driver import CudaDriverCheckpoint
from gpusnap.bench.baselines.dcp import DcpAsyncSave, DcpSave
from gpusnap.bench.baselines.pinned_copy import PinnedCopy, empty_host_cache
from gpusnap.bench.baselines.torch_save import TorchSave
from gpusnap.bench.env import CPU_DISCLAIMER, environment, fs_type
from gpusnap.bench.gpusnap_variants import (
    GpusnapBlocking,
    GpusnapConcurrent,
    GpusnapIncremental,
    warm_up_process,
)
from gpusnap.bench.measure import (
    PlainSteps,
    d2h_bandwidth,
    every_n,
    measure_save,
    plain_steps,
    timed_step,
)
from gpusnap.bench.summary import COMPARATOR, add_ratios, brief, jsonable, summarise
from gpusnap.bench.system import System, Unavailable
from gpusnap.bench.verify import clone_state
from gpusnap.bench.workloads import Workload, build_workload, missing_reason, size_for

__all__ = ["BenchOptions", "default_disk_root", "default_root", "run_bench"]


@dataclass
class BenchOptions:
    workloads: list[str]
    device: torch.device
    quick: bool
    out: str
    root: str
    disk_root: str
    size: str | None = None
    steps: int | None = None  # plain steps for the median
    warmup: int | None = None
    saves: int | None = None  # measured saves per system
    every: list[int] | None = None
    systems: list[str] | None = None
    batch: int | None = None
    seq: int | None = None
    budget_s: float | None = None
    plots: bool = True
    command: str | None = None
    log: Any = print

    def resolved(self) -> BenchOptions:
        """Fills the defaults that depend on ``quick`` and the device."""
        cpu = self.device.type == "cpu"
        self.size = self.size or size_for(self.device, self.quick)
        if self.steps is None:
            self.steps = 5 if cpu else (10 if self.quick else 30)
        if self.warmup is None:
            self.warmup = 2 if cpu else 3
        if self.saves is None:
            self.saves = 2 if (cpu or self.quick) else 3
        if self.every is None:
            self.every = [10] if (cpu or self.quick) else [1, 10, 100]
        if self.budget_s is None and self.quick and not cpu:
            self.budget_s = 480.0  # a row started late and the report still fit in 10 minutes
        return self


@dataclass
class _Budget:
    limit_s: float | None
    started: float = field(default_factory=time.perf_counter)

    def spent(self) -> bool:
        return self.limit_s is not None and time.perf_counter() - self.started > self.limit_s


def default_root() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, "gpusnap-bench")


def default_disk_root(out: str) -> str:
    tmp = os.path.join(tempfile.gettempdir(), "gpusnap-bench-disk")
    return tmp if fs_type(tempfile.gettempdir()) != "tmpfs" else os.path.join(os.path.abspath(out), "disk-ckpt")


def _systems(opts: BenchOptions, wl: Workload) -> list[System]:
    root = os.path.join(opts.root, wl.name)
    disk = os.path.join(opts.disk_root, wl.name)
    fast = "tmpfs" if fs_type(opts.root) == "tmpfs" else f"{fs_type(opts.root)} root"
    slow = "disk" if fs_type(opts.disk_root) != "tmpfs" else "disk root on tmpfs!"
    torch_fast, torch_disk = TorchSave(root, target=fast), TorchSave(disk, target=slow)
    torch_fast.key, torch_disk.key = "torch_save_tmpfs", "torch_save_disk"
    if opts.quick:
        torch_disk.max_saves = 1  # a slow disk must not eat the quick budget
    out: list[System] = [
        GpusnapConcurrent(root, target=fast),
        GpusnapIncremental(root, target=fast),
        GpusnapBlocking(root, target=fast),
        PinnedCopy(),
        torch_fast,
        DcpAsyncSave(root),
        DcpSave(root),
        CudaDriverCheckpoint(),
        torch_disk,
    ]
    if not opts.quick:
        snap_disk = GpusnapConcurrent(disk, target=slow, suffix="_disk")
        snap_disk.measures_throughput = False  # the tmpfs row measures it; this one is derived
        out.append(snap_disk)
    if opts.systems:
        out = [s for s in out if s.key in opts.systems]
    return out


def run_bench(opts: BenchOptions) -> dict[str, Any]:
    """Runs every workload; returns the results dict (the report module writes it out)."""
    opts.resolved()
    budget = _Budget(opts.budget_s)
    cpu = opts.device.type == "cpu"
    # A directory of our own under each root: only that is deleted at the end.
    run = f"run-{os.getpid()}-{int(time.time())}"
    opts.root, opts.disk_root = os.path.join(opts.root, run), os.path.join(opts.disk_root, run)
    roots = {"root": opts.root, "disk_root": opts.disk_root}
    for path in roots.values():
        os.makedirs(path, exist_ok=True)
    results: dict[str, Any] = {
        "schema": 1,
        "disclaimer": CPU_DISCLAIMER if cpu else None,
        "command": opts.command,
        "environment": environment(opts.device, roots),
        "options": {
            "workloads": opts.workloads, "quick": opts.quick, "size": opts.size, "steps": opts.steps,
            "warmup": opts.warmup, "saves": opts.saves, "every": opts.every, "systems": opts.systems,
            "batch": opts.batch, "seq": opts.seq, "budget_s": opts.budget_s,
        },
        "omitted": _omitted(opts),
        "workloads": [],
    }
    opts.log(f"gpusnap bench on {opts.device} ({opts.size} sizes); checkpoints in {opts.root}")
    if cpu:
        opts.log(CPU_DISCLAIMER)
    threads = torch.get_num_threads()
    if cpu:
        # Smoke-test machines have few cores: OpenMP workers spinning against gpusnap's and
        # DCP's threads made tiny steps jump from 5 ms to 700 ms. One intra-op thread keeps
        # the run short and its step times steady.
        torch.set_num_threads(1)
    try:
        results["gpusnap_warm_up_s"] = warm_up_process(opts.root, opts.device)
        for name in opts.workloads:
            if budget.spent():
                results["workloads"].append({"name": name, "status": "skipped: time budget (--budget-s) spent"})
                continue
            try:
                results["workloads"].append(_run_workload(name, opts, budget))
            except Exception as exc:  # noqa: BLE001  e.g. a model that does not build here: next workload
                results["workloads"].append({"name": name, "status": f"failed: {type(exc).__name__}: {exc}",
                                             "traceback": _short_traceback(exc)})
                opts.log(f"[{name}] failed: {type(exc).__name__}: {exc}")
                _free(opts.device)
    finally:
        torch.set_num_threads(threads)
        for path in roots.values():
            shutil.rmtree(path, ignore_errors=True)
    results["elapsed_s"] = time.perf_counter() - budget.started
    return results


def _omitted(opts: BenchOptions) -> list[str]:
    out = []
    if opts.quick:
        out += [
            f"throughput loss at a save every {', '.join(map(str, opts.every or []))} steps only",
            f"{opts.saves} saves per system (the first and one warm); torch.save to disk: one",
            "gpusnap concurrent to disk",
        ]
        if "resnet50" not in opts.workloads:
            out.append("ResNet-50 (add --workload resnet50)")
    if opts.size == "quick":
        out.append("full sizes: GPT-2 large runs at batch 4, decode at ~2 GB of weights and a 1024-token cache")
    if opts.size == "tiny":
        out.append("real sizes: tiny models only (CPU smoke test)")
    if opts.systems:
        out.append(f"every system but {', '.join(opts.systems)} (--systems)")
    if opts.budget_s is not None:
        out.append(f"anything left when the {opts.budget_s:.0f} s budget is spent (marked per row)")
    return out


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _run_workload(name: str, opts: BenchOptions, budget: _Budget) -> dict[str, Any]:
    reason = missing_reason(name)
    if reason is not None:
        return {"name": name, "status": f"skipped: {reason}"}
    assert opts.size is not None and opts.steps is not None and opts.warmup is not None
    t0 = time.perf_counter()
    kwargs = {"size": opts.size, "batch": opts.batch, "seq": opts.seq}
    wl = build_workload(name, opts.device, seed=0, **kwargs)  # type: ignore[arg-type]
    fresh = build_workload(name, opts.device, seed=1, **kwargs)  # type: ignore[arg-type]
    build_s = time.perf_counter() - t0
    plain = plain_steps(wl, opts.steps, warmup=opts.warmup)
    state_bytes = wl.state_bytes()
    opts.log(f"[{name}] {wl.impl}: {state_bytes / 1e9:.3f} GB of state, median step {plain.median_s * 1e3:.2f} ms")
    entry: dict[str, Any] = {
        "name": name,
        "status": "ok",
        "kind": wl.kind,
        "impl": wl.impl,
        "config": wl.config,
        "state_bytes": state_bytes,
        "build_s": build_s,
        "median_step_s": plain.median_s,
        "plain_steps_s": plain.samples,
        "plain_step_peak_extra_bytes": plain.peak_extra_bytes,
        "d2h": d2h_bandwidth(opts.device, min(state_bytes, 1 << 30)),
        "systems": [],
        "correctness": [],
    }
    if opts.device.type == "cuda":
        empty_host_cache()  # the bandwidth probe's pinned buffer must not count for the first row
    entry["notes"] = [n for n in (_space_note(opts.root, state_bytes), _space_note(opts.disk_root, state_bytes)) if n]
    for note in entry["notes"]:
        opts.log(f"[{name}] warning: {note}")
    for system in _systems(opts, wl):
        row = _run_system(wl, fresh, system, plain, opts, budget, entry["correctness"])
        summarise(row, state_bytes, plain.median_s, entry["d2h"].get("GBps"))
        entry["systems"].append(row)
        opts.log(f"[{name}] {row['system']}: {brief(row)}")
    add_ratios(entry)
    if not budget.spent() and (opts.systems is None or COMPARATOR in opts.systems):
        entry["timeline"] = _timeline(wl, plain, opts, entry["systems"])
    del wl, fresh
    _free(opts.device)
    return entry


def _run_system(
    wl: Workload,
    fresh: Workload,
    system: System,
    plain: PlainSteps,
    opts: BenchOptions,
    budget: _Budget,
    correctness: list[dict[str, Any]],
) -> dict[str, Any]:
    assert opts.saves is not None and opts.every is not None
    row: dict[str, Any] = {
        "system": system.label, "key": system.key, "family": system.family, "target": system.target,
        "status": "ok", "saves": [], "throughput": [], "restore": None, "notes": [],
    }
    reason = system.unavailable(wl)
    if reason is not None:
        row["status"] = reason
        return row
    if budget.spent():
        row["status"] = "skipped: time budget (--budget-s) spent"
        return row
    cuda = wl.device.type == "cuda"
    host_base = _host_pinned(cuda, reset=True)
    window_s = 60.0 if opts.quick else 300.0
    try:
        system.setup(wl)
        saves = min(opts.saves, system.max_saves or opts.saves)
        verify_at = {0, saves - 1} if system.key == "gpusnap_incremental" else {0}
        for i in range(saves):
            if i > 0 and budget.spent():
                row["notes"].append(f"only {i} of {saves} saves: time budget spent")
                break
            for _ in range(system.gap_steps):
                timed_step(wl)
            system.prepare_save(wl, i)
            expected = clone_state(wl) if i in verify_at else None
            timeline = system.key == COMPARATOR and i == min(1, saves - 1)
            sample = measure_save(wl, system, i, plain, max_window_steps=5000, max_window_s=window_s,
                                  record_timeline=timeline)
            row["saves"].append(sample.as_json())
            if expected is not None:
                checked = system.verify(wl, fresh, i, expected)
                if checked is not None:
                    ok, detail = checked
                    correctness.append({"system": system.key, "save": i, "ok": ok, "detail": detail})
                del expected
                _free(wl.device)
        for n in opts.every:
            if not system.measures_throughput:
                continue
            if budget.spent():
                row["notes"].append(f"throughput at every {n}: skipped, time budget spent")
                continue
            row["throughput"].append(every_n(wl, system, n, _every_steps(n), plain.median_s))
        if system.measures_restore and not budget.spent():
            row["restore"] = _restore(wl, fresh, system)
        checked = system.self_check()
        if checked is not None:
            correctness.append({"system": system.key, "save": None, "ok": checked[0], "detail": checked[1]})
        row["bytes_on_disk"] = system.bytes_on_disk()
        explicit = system.pinned_bytes()
        host_peak = _host_pinned(cuda) - host_base if cuda else None
        row["pinned_bytes"] = explicit if explicit is not None else host_peak
        row["pinned_source"] = "system" if explicit is not None else ("torch host allocator peak" if cuda else "n/a")
        row["pinned_host_allocator_peak"] = host_peak  # includes its power-of-two rounding
        row["notes"] += system.notes()
    except Unavailable as exc:
        row["status"] = f"unavailable: {exc}"
    except Exception as exc:  # noqa: BLE001  one system's failure is a row, not the end of the run
        row["status"] = f"failed: {type(exc).__name__}: {exc}"
        row["traceback"] = _short_traceback(exc)
    finally:
        try:
            system.teardown()
        except Exception as exc:  # noqa: BLE001  a failed cleanup must not hide the row's figures
            row["notes"].append(f"teardown failed: {exc}")
        if cuda:
            empty_host_cache()
        _free(wl.device)
    return row


def _short_traceback(exc: BaseException, outer: int = 4, inner: int = 16) -> str:
    """``exc``'s traceback, short enough for results.json: its outermost frames (which call of
    the bench) and its innermost (where it was raised, often deep in a library: a plain
    ``format_exc(limit=...)`` keeps only the outer end), the frames between counted."""
    te = traceback.TracebackException.from_exception(exc)
    frames = list(te.stack)
    if len(frames) <= outer + inner:
        return "".join(te.format())
    lines = ["Traceback (most recent call last):\n"]
    lines += traceback.StackSummary.from_list(frames[:outer]).format()
    lines.append(f"  ... {len(frames) - outer - inner} frames left out ...\n")
    lines += traceback.StackSummary.from_list(frames[-inner:]).format()
    lines += te.format_exception_only()
    return "".join(lines)


def _every_steps(n: int) -> int:
    """Steps of an every-N run: two saves while that is at most 20 steps, else one (N=100:
    100 steps, the save at the first); three at least (N=1: three saves). The full suite of
    GPT-2 large must fit a few 10-minute calls, and the slow baselines take seconds a save."""
    return max(2 * n if 2 * n <= 20 else n, 3)  # a multiple of N: the last save drains behind N - 1


def _space_note(root: str, state_bytes: int) -> str | None:
    """Rows write up to about three copies of the state at once (keep_last=2 plus one)."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return None
    if free >= 3 * state_bytes:
        return None
    return (f"{root} has {free / 1e9:.1f} GB free for {state_bytes / 1e9:.1f} GB of state: rows may fail "
            "with ENOSPC (pass a larger --root / --disk-root)")


def _restore(wl: Workload, fresh: Workload, system: System) -> dict[str, Any] | None:
    """The system's restore figures; a failing restore is recorded, the save figures kept."""
    try:
        restored = system.restore(wl, fresh)
    except Exception as exc:  # noqa: BLE001  the save figures stand without the restore
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": _short_traceback(exc)}
    return None if restored is None else jsonable(dict(restored.__dict__))


def _timeline(wl: Workload, plain: PlainSteps, opts: BenchOptions, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One gpusnap window for the timeline plot: a traced extra save when this gpusnap can
    write Chrome traces (its figures are not in any row: tracing costs time per op), else
    the bench's own events from the comparator row's warm save."""
    ref = next((r for r in rows if r["key"] == COMPARATOR and r["status"] == "ok"), None)
    fallback = next((s for s in (ref or {}).get("saves", []) if s.get("timeline")), None)
    if "trace_dir" not in {f.name for f in dataclasses.fields(gpusnap.Config)}:
        return {"source": "bench events", "sample": fallback,
                "note": "this gpusnap writes no capture trace: chunk copies and COW events not drawn"}
    trace_dir = os.path.join(os.path.abspath(opts.out), "traces", wl.name)
    system = GpusnapConcurrent(os.path.join(opts.root, wl.name), suffix="_traced",
                               config=gpusnap.Config.from_env(trace_dir=trace_dir))
    try:
        system.setup(wl)
        samples = []
        for i in range(2):  # the second save is warm (staging pool allocated)
            for _ in range(system.gap_steps):
                timed_step(wl)
            samples.append(measure_save(wl, system, i, plain, max_window_steps=5000, max_window_s=120.0,
                                        record_timeline=True).as_json())
    except Exception as exc:  # noqa: BLE001  the picture is optional; the figures are not
        return {"source": "bench events", "sample": fallback, "note": f"traced save failed: {type(exc).__name__}: {exc}"}
    finally:
        system.teardown()
        _free(wl.device)
    note = None if samples[-1]["stats"].get("trace_path") else "the traced save reported no trace_path"
    return {"source": "gpusnap trace (an extra save with Config.trace_dir; not counted in any row)",
            "sample": samples[-1], "note": note}


def _host_pinned(cuda: bool, *, reset: bool = False) -> int:
    """Pinned bytes held by torch's caching host allocator (its peak, after a reset)."""
    if not cuda or not hasattr(torch.cuda, "host_memory_stats"):
        return 0
    if reset and hasattr(torch.cuda, "reset_peak_host_memory_stats"):
        torch.cuda.reset_peak_host_memory_stats()
    stats = torch.cuda.host_memory_stats()
    key = "allocated_bytes.current" if reset else "allocated_bytes.peak"
    return int(stats.get(key, stats.get("allocated_bytes.all.current", 0)))
