"""Incremental saves on an inference-like workload: frozen weights, a KV cache that grows.

Run on a GPU machine from the repository root (CPU: ``--tiny``, a smoke test only):
    PYTHONPATH=src python3 benchmarks/incremental_bench.py --out incremental.json

A decode loop writes one position of a preallocated KV cache per step (position-major
layout ``[max_len, layers, 2, heads, head_dim]``, so a step's writes are contiguous) next to
several GB of frozen bf16 weights, and saves every ``--every`` steps. Per save it reports
bytes copied off the device against the bytes that changed since the previous save (the
positions written), their ratio (issue 4's target: at most 1.1x), the stall of the step
containing save(), and validation's outcome. Every checkpoint is restored into fresh
tensors and compared bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import gpusnap


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--weights-gb", type=float, default=4.0)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--every", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.tiny:
        args.weights_gb, args.layers, args.heads, args.head_dim, args.batch = 0.004, 2, 2, 16, 2
        args.max_len, args.steps, args.every = 64, 24, 4
    dtype = torch.bfloat16
    n_weight = int(args.weights_gb * 1e9 / 2 / 8)
    weights = {f"w{i}": torch.randn(n_weight, dtype=dtype, device=dev) for i in range(8)}
    cache = torch.zeros(args.max_len, args.layers, 2, args.batch, args.heads, args.head_dim, dtype=dtype, device=dev)
    row_bytes = cache[0].numel() * cache.element_size()
    app = {"weights": weights, "kv": cache, "pos": 0}
    x = torch.randn(args.batch, args.heads, args.head_dim, dtype=dtype, device=dev)

    def step(pos: int) -> None:
        # stand-in for attention + MLP: read some weights, write this position's keys/values
        # (random keys/values: real ones never repeat, and content addressing would dedup repeats)
        y = x * weights["w0"][: x.numel()].view_as(x)
        cache[pos].normal_().add_(y)
        app["pos"] = pos + 1

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="gpusnap-incr-", dir=shm)
    rows, plain = [], []
    with gpusnap.Checkpointer(os.path.join(root, "ck"), keep_last=2) as ck:
        first = ck.save(app).wait()  # the full first checkpoint (and the staging arena)
        last_pos = 0
        for pos in range(args.steps):
            sync()
            t0 = time.perf_counter()
            pending = None
            if pos and pos % args.every == 0:
                expected = {"kv": cache.clone(), "w0": weights["w0"].clone()}
                sync()
                t0 = time.perf_counter()
                pending = ck.save(app)
            step(pos)
            sync()
            elapsed = time.perf_counter() - t0
            if pending is None:
                plain.append(elapsed)
                continue
            info = pending.wait()
            fresh = {"weights": {k: torch.empty_like(v) for k, v in weights.items()},
                     "kv": torch.empty_like(cache), "pos": -1}
            ck.restore(fresh, info.id)
            exact = torch.equal(fresh["kv"], expected["kv"]) and torch.equal(fresh["weights"]["w0"], expected["w0"])
            changed = (pos - last_pos) * row_bytes
            last_pos = pos
            rows.append({"pos": pos, "step_s": elapsed, "bytes_copied": info.stats["bytes_copied"],
                         "bytes_changed": changed, "ratio": info.stats["bytes_copied"] / changed,
                         "bytes_total": info.stats["bytes_total"], "validation": info.stats["validation"],
                         "exact": exact})
    median = statistics.median(plain)
    res = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (not a performance figure)",
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "args": vars(args),
        "state_bytes": first.stats["bytes_total"], "row_bytes": row_bytes, "median_step_s": median,
        "saves": rows,
    }
    print(f"{'pos':>5}{'changed MB':>12}{'copied MB':>11}{'ratio':>7}{'stall ms':>10}  exact  validation")
    for r in rows:
        print(f"{r['pos']:>5}{r['bytes_changed'] / 1e6:>12.1f}{r['bytes_copied'] / 1e6:>11.1f}{r['ratio']:>7.2f}"
              f"{(r['step_s'] - median) * 1e3:>10.1f}  {r['exact']!s:<5}  {r['validation'][:40]}")
    print(f"state {res['state_bytes'] / 1e9:.2f} GB, median step {median * 1e3:.2f} ms, "
          f"max ratio {max(r['ratio'] for r in rows):.2f}, all exact {all(r['exact'] for r in rows)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
