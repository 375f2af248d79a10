"""What a promotion costs the training loop, and why (issue 22): a diagnosis.

One Checkpointer with a fast tier; each variant takes promoted saves and charges every step
from ``save(promote=True)`` until the promoted copy lists as durable against plain steps
timed just before it:

  PYTHONPATH=src python3 experiments/promotion_cost.py --out $OUT/promo

Variants (diagnosis only; they reach into the promoter): ``run`` (the fast tier's device
hashes checked a run of chunks at a time), ``chunk`` (one check per chunk), ``nocheck`` (no
check: what the rest costs), ``t1``/``t4``/``t16`` (promotion threads), ``idle`` (promotion
threads under SCHED_IDLE instead of nice 19).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import threading
import time

import torch

import gpusnap
import gpusnap.promotion as promotion_mod
from gpusnap.bench.measure import stream_sync
from gpusnap.bench.workloads import build_workload
from gpusnap.storage import promote as promote_mod
from gpusnap.storage.fast_tier import FastTier


def step_time(wl) -> float:
    stream_sync(wl.device)
    t0 = time.perf_counter()
    out = wl.step(None)
    if out is not None:
        out.reshape(-1)[0].item()
    return time.perf_counter() - t0


def promoted_save(ck, wl, window: int) -> dict:
    plain = [step_time(wl) for _ in range(window)]
    med = statistics.median(plain)
    cpu0, t0 = time.process_time(), time.perf_counter()
    pending = ck.save(wl.app_state, promote=True)
    times = []
    info = None
    while True:
        times.append(step_time(wl))
        if info is None and pending.done():
            info = pending.wait()
        if info is not None and any(i.id == info.id and i.tier == "durable" for i in ck.list()):
            break
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    durable = next(i for i in ck.list() if i.id == info.id and i.tier == "durable")
    return {"cost_s": sum(t - med for t in times), "steps": len(times), "wall_s": wall,
            "cpu_s": cpu - len(times) * med, "excess_ms": [round((t - med) * 1e3) for t in times[:40]],
            "promotion_s": durable.stats.get("promotion_s"), "promotion_cpu_s": durable.stats.get("promotion_cpu_s")}


def sched_idle() -> bool:
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
        return True
    except (AttributeError, OSError):
        return False


def new_promoter(ck, threads: int, lower) -> None:
    """Diagnosis only: end the Checkpointer's promoter so the next promotion starts a new one."""
    if ck._promoter is not None:
        ck._promoter.stop()
        ck._promoter = None
    ck.config = dataclasses.replace(ck.config, io_threads=threads)
    promotion_mod.lower_this_thread = lower


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="llama")
    ap.add_argument("--root", default="/dev/shm/gpusnap-promo")
    ap.add_argument("--saves", type=int, default=2)
    ap.add_argument("--window", type=int, default=15)
    ap.add_argument("--variants", default="run,chunk,nocheck,t1,t4,idle")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", default="quick")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    shutil.rmtree(args.root, ignore_errors=True)
    wl = build_workload(args.workload, torch.device(args.device), size=args.size)
    ck = gpusnap.Checkpointer(os.path.join(args.root, "durable"), keep_last=1, fast_root=os.path.join(args.root, "fast"),
                              fast_keep_last=2, promote_every=10**6)
    base_threads, base_lower, base_check = ck.config.io_threads, promotion_mod.lower_this_thread, FastTier.check_run
    report: dict = {"workload": args.workload, "io_threads": base_threads, "variants": {}}
    try:
        ck.prepare(wl.app_state, wait=True)
        for _ in range(2):
            ck.save(wl.app_state).wait()
        for name in args.variants.split(","):
            threads, lower = base_threads, base_lower
            promote_mod.RUN_BYTES = 64 << 20
            FastTier.check_run = base_check
            if name == "chunk":
                promote_mod.RUN_BYTES = 1
            elif name == "nocheck":
                FastTier.check_run = lambda self, names, chunk_size, device=None: None
            elif name.startswith("t"):
                threads = int(name[1:])
            elif name == "idle":
                lower = sched_idle
            new_promoter(ck, threads, lower)
            rows = [promoted_save(ck, wl, args.window) for _ in range(args.saves)]
            report["variants"][name] = rows
            print(f"{name:8s} " + " | ".join(
                f"cost {r['cost_s'] * 1e3:6.0f} ms over {r['steps']} steps, cpu {r['cpu_s']:.1f} s, promotion "
                f"{r['promotion_s']:.2f} s / {r['promotion_cpu_s']:.1f} CPU-s" for r in rows), flush=True)
    finally:
        FastTier.check_run = base_check
        with open(os.path.join(args.out, f"promotion_{args.workload}.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
        ck.close()
        shutil.rmtree(args.root, ignore_errors=True)
    print(f"\n{args.workload}: promoted save's cost (median of {args.saves}), io_threads {base_threads}")
    for name, rows in report["variants"].items():
        print(f"  {name:8s} {statistics.median(r['cost_s'] for r in rows) * 1e3:7.0f} ms   "
              f"promotion {statistics.median(r['promotion_s'] for r in rows):.2f} s, "
              f"{statistics.median(r['promotion_cpu_s'] for r in rows):.1f} CPU-s")


if __name__ == "__main__":
    main()
