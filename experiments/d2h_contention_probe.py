"""Why a device-to-host copy slows training (issue 22): a diagnosis, not a benchmark.

A 4 GiB side-stream copy into page-locked slab memory took 78 ms and cost training 74 ms
(experiments/fast_tier_probe.py). This profiles one training step (which CUDA runtime calls
it makes: a hidden synchronous copy would queue behind a bulk copy) and times steps while
32 GiB go device to host in several ways: copy-engine copies of 1 GiB / 32 MiB, with all
or two in flight; and SM-driven writes into mapped host memory (zero copy) from N programs.

  PYTHONPATH=src python3 experiments/d2h_contention_probe.py --out $OUT/d2h.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import threading
import time

import numpy as np
import torch

from gpusnap.bench.measure import timed_step
from gpusnap.bench.workloads import build_workload
from gpusnap.host_map import MappedMemory
from gpusnap.kernels import gather_copy as gc

GiB = 1 << 30
TOTAL = 32 * GiB


def steps_while(wl, work) -> dict:
    done = threading.Event()
    out: dict = {}

    def body() -> None:
        t0 = time.perf_counter()
        try:
            work()
        finally:
            out["work_s"] = time.perf_counter() - t0
            done.set()

    th = threading.Thread(target=body)
    th.start()
    times = []
    while not done.is_set() or len(times) < 3:
        times.append(timed_step(wl))
    th.join()
    out["steps"] = times
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="llama")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    wl = build_workload(args.workload, torch.device("cuda"), size="quick")
    for _ in range(5):
        timed_step(wl)
    med = statistics.median([timed_step(wl) for _ in range(20)])
    report: dict = {"plain_median_s": med}
    print(f"plain step {med * 1e3:.1f} ms", flush=True)

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_step(wl)
    names = collections.Counter()
    for ev in prof.events():
        if ev.name.startswith(("cuda", "Memcpy", "Memset")) and "Launch" not in ev.name:
            names[ev.name] += 1
    report["step_runtime_calls"] = dict(names)
    print("runtime calls in one step:", dict(names.most_common(20)), flush=True)

    path = "/dev/shm/d2h-probe.slab"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.posix_fallocate(fd, 0, 4 * GiB)
    host = MappedMemory(fd, 4 * GiB, pinned=True)
    os.unlink(path)
    src = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()

    def engine(piece: int, in_flight: int, s=stream):
        def work():
            events: collections.deque = collections.deque()
            with torch.cuda.stream(s):
                for done in range(0, TOTAL, piece):
                    at = done % (4 * GiB)
                    host.tensor[at : at + piece].copy_(src[at : at + piece], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(s)
                    events.append(ev)
                    while len(events) >= in_flight:
                        events.popleft().synchronize()
            s.synchronize()
        return work

    def zero_copy(programs: int, warps: int = 16):
        tile = 4 * GiB // programs // 4096 * 4096
        table = gc.tile_table(host.address, np.arange(programs, dtype=np.int64) * tile,
                              src.data_ptr() + np.arange(programs, dtype=np.int64) * tile,
                              np.full(programs, tile, dtype=np.int64), tile)
        dev = torch.from_numpy(table).to("cuda")

        def work():
            with torch.cuda.stream(stream):
                for _ in range(TOTAL // (4 * GiB)):
                    gc._t_gather_kernel[(programs,)](dev, programs, BLOCK=gc.DEFAULT_BLOCK_WORDS,
                                                    BLOCK_B=gc._BLOCK_BYTES, num_warps=warps)
            stream.synchronize()
        return work

    def idle():
        time.sleep(0.6)

    variants = {
        "idle thread 0.6 s": idle,
        "engine 1GiB all": engine(GiB, 64),
        "engine 32MiB all": engine(32 << 20, 1 << 20),
        "engine 32MiB x4": engine(32 << 20, 4),
        "engine 32MiB x1": engine(32 << 20, 1),
        "engine 4MiB x2": engine(4 << 20, 2),
        "zero-copy 132 programs": zero_copy(132),
        "zero-copy 32 programs": zero_copy(32),
        "zero-copy 16 programs": zero_copy(16),
        "zero-copy 8 programs": zero_copy(8),
        "zero-copy 4 programs": zero_copy(4),
    }
    rows = []
    src.fill_(7)
    for name, work in variants.items():
        torch.cuda.synchronize()
        r = steps_while(wl, work)
        ex = sum(r["steps"]) - med * len(r["steps"])
        gbps = TOTAL / r["work_s"] / 1e9 if "idle" not in name else 0.0
        rows.append({"variant": name, "work_s": r["work_s"], "gbps": gbps, "excess_s": ex,
                     "excess_per_copy_s": ex / r["work_s"], "steps": len(r["steps"])})
        print(f"{name:26s} {r['work_s']:.3f} s {gbps:5.1f} GB/s  training excess {ex * 1e3:6.0f} ms "
              f"({ex / r['work_s']:.2f} s per s of copying, {len(r['steps'])} steps)", flush=True)
    ok = bool(torch.equal(host.tensor[:1 << 20].to("cuda"), src[:1 << 20]))
    report["rows"] = rows
    report["zero_copy_bytes_ok"] = ok
    print("zero-copy bytes ok:", ok)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
