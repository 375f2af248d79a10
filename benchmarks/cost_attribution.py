"""Where a warm fast-tier save's cost on training goes, with its noise measured (issue 22).

Single saves of the same code have cost 0-140 ms across runs. This probe asks two things
in one process: how large is the estimator's own noise, and is the training thread short
of the interpreter lock or of the GPU while a save runs.

Each *round* is three windows of ``--window`` steps: plain, then the middle window, then
plain; the middle one is charged against the mean step of the plain windows on both sides
(drift cancels). In a *save* round the middle window holds one save (it runs on until the
save is committed); in a *null* round it holds nothing, so its "cost" is the estimator's
noise. Every step is split into its launch (Python until the step returns, the GPU still
working) and its wait (``loss.item()``): a launch-bound step pays for any lock or core
time taken from it, a wait-bound one has slack to absorb it.

  PYTHONPATH=src python3 benchmarks/cost_attribution.py --out $OUT/attr
  py-spy record --gil --threads --nonblocking -r 1000 -f raw -o $OUT/gil.txt -- \\
      python3 benchmarks/cost_attribution.py --out $OUT/attr-spy --variants base --rounds 6

``--variants``: ``base`` (defaults), ``switchN`` (``sys.setswitchinterval(N ms)`` for the
whole round), ``nohash`` (validate=False, incremental=False), ``torchcopy`` (snapshot pieces
copied through torch, not by address: ``capture/address_copy.py``). SIZE=tiny DEVICE=cpu: a CPU check.

``--default-root DIR`` measures the default ``Checkpointer(root)`` instead (issue 39): a save's
middle window runs until it is durable in ``DIR`` (promoted from the memory tier), and each
variant has a Checkpointer of its own: ``default``, ``inmemory`` (``promote_every`` never: the
capture alone), ``threads1`` (``io_threads=1``: one promotion thread), ``helper`` (``promotion_process="on"``:
promotions in a helper process, ``storage/promote_process.py``), ``nocheck`` (probe only:
the promotion's device check of the slab bytes skipped, to see its share), ``nice0`` (probe
only: the promotion's threads left at the program's priority, not lowered), ``whole`` (probe
only: slabs made a whole GiB per call with no rests, as before ``storage/slab_prep.py`` made
them in 64 MiB steps), ``threadsN`` (``io_threads=N``), ``bigcheck`` (probe only: the device
check in 256 MiB passes, not 64 MiB), ``scattered`` (probe only: no chunk gathered, each small
chunk checked in a device pass and written as a run of its own, as before), ``piece8`` (probe only: O_DIRECT writes of 8 MiB, not
64 MiB, each pinning fewer pages at a time), and the user's alternative ``pinned`` (a pinned copy plus a writer
thread that fsyncs, ``bench/baselines/pinned_writer.py``; its buffers are allocated before its
first round, as a real program would, so its "first" is a warm save), ``dcp`` (DCP ``async_save``
with its pinned ``DefaultStager``, ``bench/baselines/dcp.py``: the step after a save waits for
its staging before it changes the state; its first save pins the copy) and ``tsave``
(``torch.save`` of a host copy in a thread, ``bench/baselines/torch_save_thread.py``), all
writing to ``DIR``'s disk; ``switchN`` (``sys.setswitchinterval(N ms)`` for that variant: how
much of the cost is the interpreter lock handed to the promotion's threads). A name given twice
runs twice (reported as ``name#2``: an order effect shows as a difference). A gpusnap
variant's first window runs until its save is durable *and* the memory of the saves after it
is made.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

import gpusnap
from gpusnap.bench.measure import stream_sync
from gpusnap.bench.workloads import build_workload
from gpusnap.capture import address_copy


def step(wl, timeline: list | None = None) -> tuple[float, float]:
    """(launch, total) seconds of one step read to its loss; ``timeline`` gets
    ``(start, launch, total, main thread CPU)`` (perf_counter seconds)."""
    stream_sync(wl.device)
    t0, c0 = time.perf_counter(), time.thread_time()
    hook, BEFORE_MUTATION[0] = BEFORE_MUTATION[0], None
    out = wl.step(hook)
    t1 = time.perf_counter()
    if out is not None:
        out.reshape(-1)[0].item()
    stream_sync(wl.device)
    t2 = time.perf_counter()
    if timeline is not None:
        timeline.append((t0, t1 - t0, t2 - t0, time.thread_time() - c0))
    return t1 - t0, t2 - t0


# a baseline's hook the next step calls before it changes the state (DCP's staging copy)
BEFORE_MUTATION: list = [None]

# (kind, thread, start, end) of the promotion's parts, perf_counter seconds: filled by the
# wrappers main_default installs around FastTier.check_bytes and WriteTxn.put_run
EVENTS: list[tuple[str, str, float, float]] = []


def traced(kind: str, fn):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            EVENTS.append((kind, threading.current_thread().name, t0, time.perf_counter()))
    return wrapper


_gc_started: dict[int, float] = {}


def trace_gc(phase: str, info: dict) -> None:
    """gc.callbacks hook: each collection as an event ``gcN`` on the thread that ran it."""
    me = threading.get_ident()
    if phase == "start":
        _gc_started[me] = time.perf_counter()
    elif me in _gc_started:
        EVENTS.append((f"gc{info.get('generation')}", threading.current_thread().name, _gc_started.pop(me),
                       time.perf_counter()))


def gc_ms(events: list, start: float, end: float) -> dict[str, float]:
    """Milliseconds of collections between ``start`` and ``end``, per generation and thread."""
    out: collections.Counter = collections.Counter()
    for kind, thread, s0, e0 in events:
        if kind.startswith("gc") and s0 >= start and e0 <= end:
            out[f"{kind}:{thread}"] += (e0 - s0) * 1e3
    return {k: round(v, 2) for k, v in out.items()}


def main_sched() -> dict[str, float]:
    """The main thread's scheduler counters: CPU and run-queue wait (s), context switches."""
    tid = threading.main_thread().native_id
    out: dict[str, float] = {}
    try:
        run, wait, _slices = open(f"/proc/self/task/{tid}/schedstat").read().split()
        out["cpu_s"], out["runq_s"] = int(run) / 1e9, int(wait) / 1e9
        for line in open(f"/proc/self/task/{tid}/status"):
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                key, value = line.split(":")
                out[key.split("_")[0]] = int(value)
    except (OSError, ValueError):
        pass
    return out


def user_sys() -> collections.Counter:
    """(user, system) CPU seconds per thread name from /proc stat (10 ms ticks): Python holds
    the interpreter lock only in user time, so a thread's user time bounds its lock time."""
    out: collections.Counter = collections.Counter()
    tick = os.sysconf("SC_CLK_TCK")
    for name, tid in threads():
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name + ":user"] += int(fields[11]) / tick
        out[name + ":sys"] += int(fields[12]) / tick
    return out


def threads() -> list[tuple[str, str]]:
    """``(name, tid)`` of this process's threads: Python's name (a pool's numbering cut), else
    the OS's as ``native:<comm>``."""
    names = {str(t.native_id): t.name for t in threading.enumerate()}
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            name = names.get(tid) or "native:" + Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        out.append((name.rstrip("0123456789_"), tid))
    return out


def attribute(timeline: list, events: list, mean: float) -> dict:
    """Each middle step's excess over the plain mean, binned by what ran during it: a full
    collection on any thread, else a device check, else writes only, else nothing."""
    bins: dict[str, list[float]] = {"gc2": [], "check": [], "writes": [], "none": []}
    cpu: dict[str, list[float]] = {k: [] for k in bins}
    for start, _launch, total, step_cpu in timeline:
        end = start + total

        def overlap(kind: str) -> float:
            return sum(max(0.0, min(end, e) - max(start, s)) for k, _t, s, e in events if k == kind)

        # (a collection on any thread holds the interpreter lock: the main thread waits)
        full_gc = any(k == "gc2" and s < end and e > start for k, _t, s, e in events)
        kind = ("gc2" if full_gc else "check" if overlap("check") > 0 else "writes" if overlap("write") > 0
                else "none")
        bins[kind].append((total - mean) * 1e3)
        cpu[kind].append(step_cpu * 1e3)
    return {k: {"n": len(v), "excess_ms_sum": round(sum(v), 1), "excess_ms_mean": round(statistics.fmean(v), 2)
                if v else None, "main_cpu_ms_mean": round(statistics.fmean(cpu[k]), 2) if cpu[k] else None}
            for k, v in bins.items()}


def thread_cpu() -> collections.Counter:
    """CPU seconds per thread name (Python's name, else the OS's), from the scheduler's ns;
    and ``child:<comm>``, this process's child processes (a promotion helper), all threads."""
    out: collections.Counter = collections.Counter()
    for name, tid in threads():
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[name] += int(f.read().split()[0]) / 1e9
            with open(f"/proc/self/task/{tid}/children") as f:
                kids = f.read().split()
        except OSError:
            continue
        for pid in kids:
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[f"child:{comm}"] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def one_round(ck, wl, window: int, save: bool, durable: bool = False, prepared: int | None = None) -> dict:
    """``prepared``: the window also runs until the memory of the saves after this one is made
    (``prepare(nbytes=prepared, wait=True)``, no flatten off the training thread; waiting as a
    bystander, see ``main_default``): a first save's whole set-up is charged to it."""
    plain_line: list = []
    before = [step(wl, plain_line) for _ in range(window)]
    sched0, us0, ev0 = main_sched(), user_sys(), len(EVENTS)
    cpu0, t0 = thread_cpu(), time.perf_counter()
    pending = ck.save(wl.app_state) if save else None
    call = time.perf_counter() - t0
    settled = threading.Event()
    marks: dict[str, float] = {}

    def settle() -> None:
        try:
            ck.wait()  # (returns once the promotion is done too)
            marks["durable_s"] = time.perf_counter() - t0
            if prepared is not None:
                ck.prepare(nbytes=prepared, wait=True)
                marks["prepared_s"] = time.perf_counter() - t0
        finally:  # (a failed save ends the window too: pending.wait() below raises it)
            settled.set()

    if pending is not None and durable:
        threading.Thread(target=settle, daemon=True).start()
    elif pending is not None:
        threading.Thread(target=lambda: (pending.wait(), settled.set()), daemon=True).start()
    else:
        settled.set()
    mid, line = [], []
    while len(mid) < window or not settled.is_set():
        mid.append(step(wl, line))
    wall = time.perf_counter() - t0
    cpu1, sched1, us1, events = thread_cpu(), main_sched(), user_sys(), EVENTS[ev0:]
    info = pending.wait() if pending is not None else None
    sched_a, ev_b, t_after = main_sched(), len(EVENTS), time.perf_counter()
    after = [step(wl, plain_line) for _ in range(window)]
    sched_b = main_sched()
    plain = [t for _, t in before + after]
    mean = statistics.fmean(plain)
    launch_mean = statistics.fmean(launch for launch, _ in before + after)
    main = "MainThread"
    return {
        "cost_ms": (wall - len(mid) * mean) * 1e3,
        "call_ms": call * 1e3,
        "steps": len(mid),
        "step_ms": mean * 1e3,
        "plain_launch_ms": launch_mean * 1e3,
        "plain_sd_ms": statistics.pstdev(plain) * 1e3,
        "drift_ms": (statistics.fmean(t for _, t in after) - statistics.fmean(t for _, t in before)) * 1e3,
        "excess_ms": [round((t - mean) * 1e3, 1) for _, t in mid[:10]],
        "launch_excess_ms": [round((launch - launch_mean) * 1e3, 1) for launch, _ in mid[:10]],
        "main_cpu_ms": (cpu1[main] - cpu0[main]) * 1e3,
        "other_cpu_ms": {k: round((cpu1[k] - cpu0.get(k, 0.0)) * 1e3, 1) for k in cpu1 if k != main
                         and cpu1[k] - cpu0.get(k, 0.0) > 0.001},
        "duration_s": info.stats.get("duration_s") if info is not None else None,
        # per step: the main thread's scheduler counters in the middle window and in the plain one after
        "main_sched_per_step": {k: round((sched1[k] - sched0[k]) / len(mid), 5) for k in sched1 if k in sched0},
        "plain_sched_per_step": {k: round((sched_b[k] - sched_a[k]) / window, 5) for k in sched_b if k in sched_a},
        "user_sys_s": {k: round(us1[k] - us0.get(k, 0.0), 2) for k in us1 if us1[k] - us0.get(k, 0.0) > 0.005},
        "bins": attribute(line, events, mean),
        "gc_ms": gc_ms(events, t0, t0 + wall),
        "plain_gc_ms": gc_ms(EVENTS[ev_b:], t_after, time.perf_counter()),
        "plain_cpu_ms_mean": statistics.fmean(c for *_x, c in plain_line) * 1e3,
        "timeline": [(round((s0 - t0) * 1e3, 1), round(tl * 1e3, 1), round(tt * 1e3, 1), round(c * 1e3, 1))
                     for s0, tl, tt, c in line],
        "events": [(k, n, round((s0 - t0) * 1e3, 1), round((e - t0) * 1e3, 1)) for k, n, s0, e in events],
        "stats": {k: info.stats.get(k) for k in _STATS} if info is not None else None,
        **marks,
    }


# what a save's own stats say about where its window went (printed for each variant's first save)
_STATS = ("window_s", "stall_s", "wait_s", "waits", "tracked", "bytes_snapshot", "bytes_cow", "copier_s",
          "save_phases_s", "fast_prepared_bytes", "fast_tier_bytes", "copy_path")


def rounds(ck, wl, args, name: str, durable: bool = False) -> dict[str, list[dict]]:
    """``args.rounds`` save rounds and half as many null ones, interleaved, each printed."""
    rows: dict[str, list[dict]] = {"save": [], "null": []}
    for i in range(args.rounds + args.rounds // 2):
        kind = "null" if i % 3 == 2 else "save"
        rows[kind].append(one_round(ck, wl, args.window, kind == "save", durable=durable))
        r = rows[kind][-1]
        print(f"{name} {kind}: cost {r['cost_ms']:6.1f} ms, steps {r['steps']}, call {r['call_ms']:.1f} ms, "
              f"drift {r['drift_ms']:+.1f}, main CPU {r['main_cpu_ms']:.0f} ms, ex {r['excess_ms'][:10]}, "
              f"launch ex {r['launch_excess_ms'][:10]}, others {r['other_cpu_ms']}", flush=True)
        print(f"   bins {json.dumps(r['bins'])}\n   main sched/step {r['main_sched_per_step']} plain {r['plain_sched_per_step']} "
              f"plain cpu {r['plain_cpu_ms_mean']:.1f} ms\n   user/sys {r['user_sys_s']}\n   gc {r['gc_ms']} plain gc {r['plain_gc_ms']}", flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    costs = [r["cost_ms"] for r in rows]
    others = collections.Counter()
    for r in rows:
        others.update(r["other_cpu_ms"])
    return {"n": len(rows), "median_ms": statistics.median(costs), "mean_ms": statistics.fmean(costs),
            "sd_ms": statistics.pstdev(costs), "min_ms": min(costs), "max_ms": max(costs),
            "call_ms": statistics.median(r["call_ms"] for r in rows),
            "main_cpu_ms_per_window_minus_steps": statistics.median(r["main_cpu_ms"] for r in rows),
            "launch_share": statistics.median(r["plain_launch_ms"] / r["step_ms"] for r in rows),
            "other_cpu_ms_mean": {k: round(v / len(rows), 1) for k, v in others.most_common(8)}}


def variant_entry(rows: dict[str, list[dict]]) -> dict:
    return {"rows": rows, "save": summary(rows["save"]), "null": summary(rows["null"])}


def write_report(out: str, report: dict) -> None:
    with open(os.path.join(out, "attribution.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)


def print_other_cpu(report: dict) -> None:
    for name, v in report["variants"].items():
        print(f"{name}: other threads' CPU per save window (ms): {v['save']['other_cpu_ms_mean']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="llama")
    ap.add_argument("--root", default="/dev/shm/gpusnap-attr")
    ap.add_argument("--rounds", type=int, default=8, help="save rounds per variant (and half as many null rounds)")
    ap.add_argument("--window", type=int, default=12)
    ap.add_argument("--variants", default=None,
                    help="comma-separated (default: base,switch0.5,switch20; with --default-root: "
                         "default,inmemory,nocheck,threads1)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--default-root", default=None)
    args = ap.parse_args()
    if args.default_root:
        return main_default(args)
    os.makedirs(args.out, exist_ok=True)
    shutil.rmtree(args.root, ignore_errors=True)
    wl = build_workload(args.workload, torch.device(os.environ.get("DEVICE", "cuda")), size=os.environ.get("SIZE", "quick"))
    ck = gpusnap.Checkpointer(os.path.join(args.root, "durable"), keep_last=1, fast_root=os.path.join(args.root, "fast"),
                              fast_keep_last=2, promote_every=10**6)
    base, switch0 = ck.config, sys.getswitchinterval()
    report: dict = {"workload": args.workload, "variants": {}}
    try:
        ck.prepare(wl.app_state, wait=True)
        for _ in range(2):  # warm: the first saves of a process are issue 22's other row
            one_round(ck, wl, args.window, True)
        for name in (args.variants or "base,switch0.5,switch20").split(","):
            ck.config = dataclasses.replace(base, validate=False, incremental=False) if name == "nohash" else base
            sys.setswitchinterval(float(name[6:]) / 1e3 if name.startswith("switch") else switch0)
            address_copy.ENABLED = name != "torchcopy"
            rows = rounds(ck, wl, args, name)
            report["variants"][name] = variant_entry(rows)
    finally:
        sys.setswitchinterval(switch0)
        address_copy.ENABLED = True
        ck.close()
        shutil.rmtree(args.root, ignore_errors=True)
        write_report(args.out, report)
    print("\n| variant | save: median (mean ± sd) ms | null: median (mean ± sd) ms | save() call | launch share of a step |")
    print("|---|---:|---:|---:|---:|")
    for name, v in report["variants"].items():
        s, n = v["save"], v["null"]
        print(f"| {name} | {s['median_ms']:.1f} ({s['mean_ms']:.1f} ± {s['sd_ms']:.1f}) | {n['median_ms']:.1f} "
              f"({n['mean_ms']:.1f} ± {n['sd_ms']:.1f}) | {s['call_ms']:.1f} | {s['launch_share']:.2f} |")
    print_other_cpu(report)


class SystemAsCheckpointer:
    """A baseline (``bench/baselines``) behind the two calls ``one_round`` makes of a
    Checkpointer: ``save()`` and ``wait()`` (until durable). A save's before-mutation hook
    (DCP's staging) is called by the next step before it changes the state, as the cost
    suite does."""

    def __init__(self, root: str, wl, name: str) -> None:
        from gpusnap.bench.baselines.dcp import DcpAsyncSave
        from gpusnap.bench.baselines.pinned_writer import PinnedWriter
        from gpusnap.bench.baselines.torch_save_thread import TorchSaveThread
        system = {"pinned": lambda: PinnedWriter(root, target="disk"), "dcp": lambda: DcpAsyncSave(root),
                  "tsave": lambda: TorchSaveThread(root, target="disk")}[name]()
        self.system, self.wl, self.index, self.handle = system, wl, 0, None
        self.system.setup(wl)

    def save(self, _app_state):
        self.handle, self.index = self.system.save(self.wl, self.index), self.index + 1
        BEFORE_MUTATION[0] = self.handle.before_mutation
        return self

    def wait(self):
        if self.handle is not None:
            self.handle.wait()
            self.system.prepare_save(self.wl, self.index)  # (keep the newest only, as keep_last=1)
        return None

    def close(self) -> None:
        self.system.teardown()


def main_default(args) -> None:
    from gpusnap.save import promotion
    from gpusnap.storage.fast_tier import FastTier
    os.makedirs(args.out, exist_ok=True)
    wl = build_workload(args.workload, torch.device(os.environ.get("DEVICE", "cuda")), size=os.environ.get("SIZE", "quick"))
    report: dict = {"workload": args.workload, "variants": {}}
    for _ in range(2 * args.window):  # (a process's first steps are slower: the first variant's
        step(wl)  # first round charged against them came out below zero)
    from gpusnap.storage import direct_file, fast_tier, slab_prep
    from gpusnap.storage.txn import WriteTxn
    check, lower, steps = FastTier.check_bytes, promotion.lower_this_thread, (slab_prep.STEP_BYTES, slab_prep.REST_FACTOR)
    from gpusnap.storage import promote as promote_mod
    put_run, commit, piece, slice_bytes = WriteTxn.put_run, WriteTxn.commit, direct_file._PIECE, fast_tier.DEVICE_SLICE_BYTES
    small = promote_mod.SMALL_BYTES
    WriteTxn.put_run, WriteTxn.commit = traced("write", put_run), traced("commit", commit)
    import gc
    gc.callbacks.append(trace_gc)
    waited = FastTier.wait_prepared
    # the bench's wait for the later saves' memory must not hurry its making (prepare(wait=True)
    # would): it measures a program that never calls prepare()
    FastTier.wait_prepared = lambda self, timeout=None: self._preparer.join(timeout)
    state_bytes = sum(t.untyped_storage().nbytes() for t in wl.tensors().values())
    switch = sys.getswitchinterval()
    try:
        seen: collections.Counter = collections.Counter()
        for name in (args.variants or "default,inmemory,nocheck,threads1").split(","):
            seen[name] += 1
            key = name if seen[name] == 1 else f"{name}#{seen[name]}"  # (a variant again: order effects)
            root = os.path.join(args.default_root, f"attr-{name}")
            shutil.rmtree(root, ignore_errors=True)
            config = gpusnap.Config.from_env()
            if name.startswith("threads"):
                config = dataclasses.replace(config, io_threads=int(name[7:]))
            if name == "helper":
                config = dataclasses.replace(config, promotion_process="on")
            FastTier.check_bytes = traced("check", (lambda *a, **k: None) if name == "nocheck" else check)
            fast_tier.DEVICE_SLICE_BYTES = 256 << 20 if name == "bigcheck" else slice_bytes
            direct_file._PIECE = 8 << 20 if name == "piece8" else piece
            promote_mod.SMALL_BYTES = 0 if name == "scattered" else small
            promotion.lower_this_thread = (lambda: False) if name == "nice0" else lower
            slab_prep.STEP_BYTES, slab_prep.REST_FACTOR = (1 << 30, 0.0) if name == "whole" else steps
            sys.setswitchinterval(float(name[6:]) / 1e3 if name.startswith("switch") else switch)
            baseline = name in ("pinned", "dcp", "tsave")
            ck = SystemAsCheckpointer(root, wl, name) if baseline else gpusnap.Checkpointer(
                root, keep_last=1, config=config, promote_every=10**6 if name == "inmemory" else None)
            try:
                first = one_round(ck, wl, args.window, True, durable=True,
                                  prepared=None if baseline else state_bytes)
                print(f"{key} first: cost {first['cost_ms']:.1f} ms, steps {first['steps']}, durable at "
                      f"{first.get('durable_s', 0):.2f} s, later saves' memory made at {first.get('prepared_s', 0):.2f} s, "
                      f"excess {first['excess_ms']}, "
                      f"stats {json.dumps(first['stats'], default=str)}", flush=True)
                one_round(ck, wl, args.window, True, durable=True)
                rows = rounds(ck, wl, args, key, durable=True)
                rows["first"] = [first]
                report["variants"][key] = variant_entry(rows)
                write_report(args.out, report)  # (each variant as it ends: a run cut short keeps them)
            finally:
                ck.close()
                shutil.rmtree(root, ignore_errors=True)
    finally:
        FastTier.check_bytes, promotion.lower_this_thread, FastTier.wait_prepared = check, lower, waited
        WriteTxn.put_run, WriteTxn.commit = put_run, commit
        direct_file._PIECE, fast_tier.DEVICE_SLICE_BYTES = piece, slice_bytes
        promote_mod.SMALL_BYTES = small
        slab_prep.STEP_BYTES, slab_prep.REST_FACTOR = steps
        sys.setswitchinterval(switch)
        write_report(args.out, report)
    print("\n| variant | save: median (mean ± sd) ms | null: median ms | steps in a save window | first save ms |")
    print("|---|---:|---:|---:|---:|")
    for name, v in report["variants"].items():
        s, n = v["save"], v["null"]
        steps = statistics.median(r["steps"] for r in v["rows"]["save"])
        print(f"| {name} | {s['median_ms']:.1f} ({s['mean_ms']:.1f} ± {s['sd_ms']:.1f}) | {n['median_ms']:.1f} | {steps} "
              f"| {v['rows']['first'][0]['cost_ms']:.0f} |")
    print_other_cpu(report)
    print("\n| variant | steps with a full gc: n, excess mean (ms), main CPU | with a check | writes only | neither | main thread per step, save / plain: CPU ms, run-queue ms, voluntary switches | gc ms per save window (main thread / others) |")
    print("|---|---|---|---|---|---|---|")
    for name, v in report["variants"].items():
        rows = v["rows"]["save"]
        cells = []
        for kind in ("gc2", "check", "writes", "none"):
            n = sum(r["bins"][kind]["n"] for r in rows)
            ex = sum(r["bins"][kind]["excess_ms_sum"] for r in rows)
            cpus = [r["bins"][kind]["main_cpu_ms_mean"] for r in rows if r["bins"][kind]["n"]]
            cells.append(f"{n}, {ex / n if n else 0:+.2f}, {statistics.fmean(cpus) if cpus else 0:.1f}")
        sched = {k: statistics.median(r["main_sched_per_step"].get(k, 0) for r in rows) for k in ("cpu_s", "runq_s", "voluntary")}
        plain = {k: statistics.median(r["plain_sched_per_step"].get(k, 0) for r in rows) for k in ("cpu_s", "runq_s", "voluntary")}
        print(f"| {name} | " + " | ".join(cells) + f" | {sched['cpu_s']*1e3:.1f} / {plain['cpu_s']*1e3:.1f}, "
              f"{sched['runq_s']*1e3:.2f} / {plain['runq_s']*1e3:.2f}, {sched['voluntary']:.0f} / {plain['voluntary']:.0f} | "
              f"{statistics.fmean(sum(v for k, v in r['gc_ms'].items() if k.endswith(':MainThread')) for r in rows):.1f} / "
              f"{statistics.fmean(sum(v for k, v in r['gc_ms'].items() if not k.endswith(':MainThread')) for r in rows):.1f} |")


if __name__ == "__main__":
    main()
