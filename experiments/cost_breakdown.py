"""Where a warm fast-tier save's ~100 ms of training cost goes (issue 22): a diagnosis.

One Checkpointer with a fast tier; after warm-up saves, each variant changes one per-save
option (``ck.config`` is read at every save) and takes a few saves, each charged against
plain steps timed just before it, step by step, so the excess shows *which* steps pay:

  PYTHONPATH=src python3 experiments/cost_breakdown.py --out $OUT/breakdown

Variants: the suite's loop (loss read every step) and the probe's (stream sync only);
hashing off (validate=False, incremental=False); smaller and larger copy pieces. Last, one
window under ``torch.profiler``: GPU time per stream and per kernel family while it is open.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import time
from collections import defaultdict

import torch

import gpusnap
from gpusnap.bench.measure import stream_sync
from gpusnap.bench.workloads import build_workload

MiB = 1 << 20


def step_time(wl, read_loss: bool) -> float:
    stream_sync(wl.device)
    t0 = time.perf_counter()
    out = wl.step(None)
    if read_loss and out is not None:
        out.reshape(-1)[0].item()
    else:
        stream_sync(wl.device)
    return time.perf_counter() - t0


def one_save(ck, wl, read_loss: bool, window: int) -> dict:
    plain = [step_time(wl, read_loss) for _ in range(window)]
    med = statistics.median(plain)
    stream_sync(wl.device)
    t0 = time.perf_counter()
    pending = ck.save(wl.app_state)
    call = time.perf_counter() - t0
    times = [step_time(wl, read_loss)]
    committed_at = None
    while len(times) < window or committed_at is None:
        if committed_at is None and pending.done():
            committed_at = len(times)
        times.append(step_time(wl, read_loss))
    info = pending.wait()
    excess = [t - med for t in times]
    ph = info.stats.get("save_phases_s", {})
    return {"plain_med_s": med, "plain_spread_s": max(plain) - min(plain), "call_s": call,
            "cost_s": call + sum(excess), "cost_vs_mean_s": call + sum(times) - len(times) * statistics.fmean(plain),
            "steps": len(times), "committed_after_steps": committed_at,
            "excess_ms": [round(e * 1e3, 1) for e in excess[:12]], "duration_s": info.stats.get("duration_s"),
            "phases_ms": {k: round(v * 1e3, 2) for k, v in sorted(ph.items(), key=lambda kv: -kv[1])[:8]},
            "bytes_copied": info.stats.get("bytes_copied"), "bytes_skipped": info.stats.get("bytes_skipped")}


def profile_window(ck, wl, out_dir: str) -> dict:
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        step_time(wl, True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        pending = ck.save(wl.app_state)
        n = 0
        while not pending.done() or n < 6:
            step_time(wl, True)
            n += 1
        pending.wait()
    prof.export_chrome_trace(os.path.join(out_dir, "window.trace.json"))
    with open(os.path.join(out_dir, "window.key_averages.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=60))
    per_stream: dict[str, float] = defaultdict(float)
    family: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        dur = ev.time_range.elapsed_us() / 1e3
        per_stream[str(getattr(ev, "device_resource_id", "?"))] += dur
        name = ev.name.lower()
        fam = ("memcpy_dtoh" if "dtoh" in name or "device -> pinned" in name or "memcpy dtoh" in name else
               "memcpy_dtod" if "dtod" in name else
               "gpusnap_hash" if "hash" in name or "nh128" in name else
               "gpusnap_gather" if "gather" in name else "other")
        family[fam] += dur
    return {"steps": n, "gpu_ms_per_stream": dict(per_stream), "gpu_ms_per_family": dict(family)}


def compiled_part(root: str, window: int) -> dict:
    """A ``torch.compile``d GPT-2 (124M, fused AdamW): its first window and later ones, and
    whether any window made dynamo compile again."""
    from torch._dynamo.utils import counters
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpusnap.bench.workloads import Workload, _primed, _train_state

    with torch.device("cuda"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257))
        data = torch.randint(0, 50257, (8, 512))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    compiled = torch.compile(model)
    state = _train_state(model, optim)

    def step(hook=None):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = compiled(input_ids=data, labels=data).loss
        out.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        return out.detach()

    wl = _primed(Workload("gpt2-compiled", "training", torch.device("cuda"), state, step, "compiled", {}))
    for _ in range(5):
        step_time(wl, True)
    ck = gpusnap.Checkpointer(os.path.join(root, "cd"), keep_last=1, fast_root=os.path.join(root, "cf"),
                              fast_keep_last=2, promote_every=10**6)
    made = ck.prepare(wl.app_state, wait=True)
    graphs0 = dict(counters["stats"])
    rows = []
    try:
        for i in range(4):
            rows.append(one_save(ck, wl, True, window))
            print(f"compiled save {i}: cost {rows[-1]['cost_s'] * 1e3:.0f} ms, call {rows[-1]['call_s'] * 1e3:.0f} ms, "
                  f"ex {rows[-1]['excess_ms'][:6]}", flush=True)
    finally:
        ck.close()
    return {"prepared_bytes": made, "saves": rows, "dynamo_stats_before": graphs0,
            "dynamo_stats_after": dict(counters["stats"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="llama")
    ap.add_argument("--root", default="/dev/shm/gpusnap-breakdown")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--variants", default="suite,probe,nohash,piece8,piece128,suite2")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compiled", action="store_true", help="only the compiled-model part")
    ap.add_argument("--size", default="quick")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    shutil.rmtree(args.root, ignore_errors=True)
    if args.compiled:
        try:
            out = compiled_part(args.root, args.window)
        finally:
            shutil.rmtree(args.root, ignore_errors=True)
        with open(os.path.join(args.out, "compiled.json"), "w") as f:
            json.dump(out, f, indent=1, default=str)
        print("compiled: cost (ms) " + ", ".join(f"{r['cost_s'] * 1e3:.0f}" for r in out["saves"]) +
              f"; dynamo stats {out['dynamo_stats_before']} -> {out['dynamo_stats_after']}")
        return
    wl = build_workload(args.workload, torch.device(args.device), size=args.size)
    state = sum(t.numel() * t.element_size() for t in wl.tensors().values())
    ck = gpusnap.Checkpointer(os.path.join(args.root, "durable"), keep_last=1, fast_root=os.path.join(args.root, "fast"),
                              fast_keep_last=2, promote_every=10**6)
    base = ck.config
    report: dict = {"workload": args.workload, "state_bytes": state, "variants": {}, "first": []}
    try:
        t0 = time.perf_counter()
        report["prepared_bytes"] = ck.prepare(wl.app_state, wait=True)
        report["prepare_s"] = time.perf_counter() - t0
        print(f"prepare: {report['prepared_bytes'] / 1e9:.1f} GB in {report['prepare_s']:.1f} s", flush=True)
        for i in range(3):  # the first saves of the process (slabs made by prepare())
            r = one_save(ck, wl, True, args.window)
            report["first"].append(r)
            print(f"first {i}: cost {r['cost_s'] * 1e3:.0f} ms, call {r['call_s'] * 1e3:.0f} ms, ex {r['excess_ms'][:6]}, "
                  f"phases {r['phases_ms']}", flush=True)
        opts = {"suite": ({}, True), "suite2": ({}, True), "probe": ({}, False),
                "nohash": ({"validate": False, "incremental": False}, True),
                "piece8": ({"copy_piece_bytes": 8 * MiB}, True), "piece128": ({"copy_piece_bytes": 128 * MiB}, True),
                "ahead2": ({"copy_ahead": 2}, True)}
        for name in args.variants.split(","):
            change, read_loss = opts[name]
            ck.config = dataclasses.replace(base, **change)
            rows = [one_save(ck, wl, read_loss, args.window) for _ in range(args.saves)]
            report["variants"][name] = rows
            print(f"{name:9s} " + " | ".join(
                f"cost {r['cost_s'] * 1e3:5.0f} ms (vs mean {r['cost_vs_mean_s'] * 1e3:4.0f}) call {r['call_s'] * 1e3:3.0f} "
                f"commit {r['duration_s']:.2f}s@{r['committed_after_steps']} ex {r['excess_ms'][:6]}" for r in rows), flush=True)
        ck.config = base
        if not args.no_profile:
            report["profile"] = profile_window(ck, wl, args.out)
            print("profile:", json.dumps(report["profile"]), flush=True)
    finally:
        with open(os.path.join(args.out, f"{args.workload}.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
        ck.close()
        shutil.rmtree(args.root, ignore_errors=True)
    print(f"\n{args.workload}: state {state / 1e9:.2f} GB; cost per save (ms), median of {args.saves}")
    for name, rows in report["variants"].items():
        print(f"  {name:9s} {statistics.median(r['cost_s'] for r in rows) * 1e3:6.0f}   "
              f"call {statistics.median(r['call_s'] for r in rows) * 1e3:4.0f}   "
              f"commit {statistics.median(r['duration_s'] for r in rows):.2f} s")


if __name__ == "__main__":
    main()
