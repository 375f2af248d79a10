"""What a default save costs a ``torch.compile``d training loop, and whether it recompiles.

GPT-2 124M from transformers, compiled, bf16 autocast, fused AdamW (CUDA only). One
``Checkpointer(root)`` as the README makes it (its memory tier, no ``prepare()``; with
``--prepare``, ``prepare(wait=True)`` at set-up); then four
saves, each charged step by step against ``--window`` plain steps timed just before it (the
window runs on until the save is committed in memory; its durable write goes on behind), and
dynamo's counters before and after: a second graph would mean a save made dynamo compile again.

  PYTHONPATH=src python3 benchmarks/compiled_cost.py --root /path/on/disk --out $OUT/compiled --window 20
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from typing import Any

import torch

import gpusnap
from gpusnap.bench.cost import read_step
from gpusnap.bench.measure import stream_sync
from gpusnap.bench.workloads import Hook, Workload, _primed, _train_state


def step_time(wl: Workload) -> float:
    """One step read to its loss, as a training loop reads it."""
    stream_sync(wl.device)
    t0 = time.perf_counter()
    read_step(wl)
    return time.perf_counter() - t0


def one_save(ck: gpusnap.Checkpointer, wl: Workload, window: int) -> dict[str, Any]:
    plain = [step_time(wl) for _ in range(window)]
    med = statistics.median(plain)
    stream_sync(wl.device)
    t0 = time.perf_counter()
    pending = ck.save(wl.app_state)
    call = time.perf_counter() - t0
    times = [step_time(wl)]
    committed_at = None
    while len(times) < window or committed_at is None:
        if committed_at is None and pending.done():
            committed_at = len(times)
        times.append(step_time(wl))
    info = pending.wait()
    excess = [t - med for t in times]
    return {"plain_med_s": med, "call_s": call, "cost_s": call + sum(excess), "steps": len(times),
            "committed_after_steps": committed_at, "excess_ms": [round(e * 1e3, 1) for e in excess[:12]],
            "duration_s": info.stats.get("duration_s")}


def compiled_gpt2() -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("cuda"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257))
        data = torch.randint(0, 50257, (8, 512))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    compiled = torch.compile(model)
    state = _train_state(model, optim)

    def step(hook: Hook | None = None) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = compiled(input_ids=data, labels=data).loss
        out.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        return out.detach()

    return _primed(Workload("gpt2-compiled", "training", torch.device("cuda"), state, step, "compiled", {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="gpusnap-compiled")
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prepare", action="store_true",
                    help="call ckpt.prepare(wait=True) at set-up: what remains of the first window then")
    args = ap.parse_args()
    from torch._dynamo.utils import counters

    os.makedirs(args.out, exist_ok=True)
    shutil.rmtree(args.root, ignore_errors=True)
    wl = compiled_gpt2()
    for _ in range(5):
        step_time(wl)
    ck = gpusnap.Checkpointer(os.path.join(args.root, "durable"), keep_last=1)
    rows = []
    # without --prepare the first save is the user's first: it makes the memory and loads the kernels
    made = ck.prepare(wl.app_state, wait=True) if args.prepare else None
    try:
        before = dict(counters["stats"])
        for i in range(4):
            rows.append(one_save(ck, wl, args.window))
            print(f"compiled save {i}: cost {rows[-1]['cost_s'] * 1e3:.0f} ms, call {rows[-1]['call_s'] * 1e3:.0f} ms, "
                  f"ex {rows[-1]['excess_ms'][:6]}", flush=True)
        after = dict(counters["stats"])
    finally:
        ck.close()
        shutil.rmtree(args.root, ignore_errors=True)
    with open(os.path.join(args.out, "compiled.json"), "w") as f:
        json.dump({"prepared_bytes": made, "saves": rows, "dynamo_stats_before": before,
                   "dynamo_stats_after": after}, f, indent=1, default=str)
    print("compiled: cost (ms) " + ", ".join(f"{r['cost_s'] * 1e3:.0f}" for r in rows) +
          f"; dynamo stats {before} -> {after}")


if __name__ == "__main__":
    main()
