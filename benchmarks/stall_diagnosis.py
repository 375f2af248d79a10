"""Where does a concurrent save's stall come from? (GPU diagnostic, not a benchmark)

GPT-2 large training with a concurrent save every ``--every`` steps, in variants that switch
parts of the save's background work off (the checkpoints of variants 2-3 are NOT valid):
  full      the real thing (validation and incremental on: the defaults)
  plain     validation and incremental off
  poll      the copier waits for copies by polling event.query() (sleeping 50 us) instead of
            event.synchronize()
  no-hash   chunk digests replaced by random ids (still copied, still written to tmpfs)
  no-store  pieces copied off the device, then dropped (no hashing, no writing, no validation)
  switch    full, with the GIL's switch interval cut from 5 ms to 50 us (if the stall shrinks,
            background Python holding the GIL starves the program's launches)
Prints, per variant, the median stall of the step containing save() and of the whole interval,
and the host time of the steps inside the window (until every op was enqueued) against the
same at rest: a host time near the step time means the program's thread, not the GPU, is slow.
--trace-dir writes a Chrome trace of each variant's windows there.
Run: PYTHONPATH=src python3 benchmarks/stall_diagnosis.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
import concurrent_stall as cs  # noqa: E402

import gpusnap  # noqa: E402
from gpusnap.capture import concurrent as _concurrent  # noqa: E402
from gpusnap.capture import copier as _copier  # noqa: E402


def drop_store(self, index, start, data) -> None:  # noqa: ANN001
    pass  # the region is released by the caller


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-large")
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--saves", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--variants", default="full,plain,no-store,poll,switch")
    ap.add_argument("--trace-dir", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, optim = cs.build(args.model, dev)
    data = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=dev)
    loop = cs.Loop(model, optim, data, dev)
    for _ in range(3):
        loop.step()
    rest_steps = []
    for _ in range(8):
        rest_steps.append((loop.step(), loop.host_s))
    median = statistics.median(t for t, _ in rest_steps)
    host_rest = statistics.median(h for _, h in rest_steps)
    app = {"model": model, "optim": optim}
    root = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    real_store, real_digest = _concurrent.ConcurrentSave._store, _concurrent.chunk_digest
    rows = []
    for variant in args.variants.split(","):
        _copier.POLL_S = 50e-6 if variant == "poll" else None
        sys.setswitchinterval(50e-6 if variant == "switch" else 5e-3)
        _concurrent.ConcurrentSave._store = drop_store if variant == "no-store" else real_store
        _concurrent.chunk_digest = (lambda view: os.urandom(16).hex()) if variant == "no-hash" else real_digest
        knobs = {"validate": False, "incremental": False} if variant in ("plain", "no-store") else {}
        if args.trace_dir:
            knobs["trace_dir"] = os.path.join(args.trace_dir, variant)
        config = gpusnap.Config.from_env(**knobs)
        with gpusnap.Checkpointer(os.path.join(root, f"{variant}-{len(rows)}"), keep_last=1, config=config) as ck:
            ck.save(app).wait()  # grows the staging arena; not measured
            steps, intervals, windows, hosts, in_window = [], [], [], [], []
            for _ in range(args.saves):
                box = {}
                t = loop.step(lambda: box.setdefault("p", ck.save(app)), "after")
                hosts.append(loop.host_s)
                rest = []
                for _ in range(args.every - 1):
                    rest.append(loop.step())
                    if not box["p"].staged():  # a step that ran with the window open
                        hosts.append(loop.host_s)
                        in_window.append(rest[-1])
                info = box["p"].wait()
                steps.append(t - median)
                intervals.append(t + sum(rest) - args.every * median)
                windows.append(info.stats["window_s"])
        rows.append((variant, statistics.median(steps), statistics.median(intervals), statistics.median(windows),
                     statistics.median(hosts), statistics.median(in_window) if in_window else float("nan")))
    _concurrent.ConcurrentSave._store, _concurrent.chunk_digest = real_store, real_digest
    print(f"median step {median * 1e3:.1f} ms, host time at rest {host_rest * 1e3:.1f} ms")
    print(f"{'variant':<10}{'save step +ms':>15}{'interval +ms':>14}{'window ms':>11}{'host in window ms':>19}"
          f"{'step in window ms':>19}")
    for v, s, i, w, h, sw in rows:
        print(f"{v:<10}{s * 1e3:>15.1f}{i * 1e3:>14.1f}{w * 1e3:>11.1f}{h * 1e3:>19.1f}{sw * 1e3:>19.1f}")


if __name__ == "__main__":
    main()
