"""How many objects one save and its promotion move into Python's oldest generation.

Python's collector runs a full collection of the heap (every object of a training process:
~0.2 s holding the interpreter lock, BENCHMARKS.md, 2026-12-07, sixth) once the objects moved
into its oldest generation since the last one exceed a quarter of those it holds. So the
objects a save moves there (survivors of a generation-1 collection) set how often a program
that saves pays for a full collection. This counts them, by type, on CPU: the counts are a
property of the code, not of the machine. The promotion's device check is skipped (on CPU
it is torch's slow host hash, which makes objects of its own).

  PYTHONPATH=src python3 benchmarks/collector_probe.py [--tensors 600] [--saves 4]
"""

from __future__ import annotations

import argparse
import collections
import gc
import shutil
import tempfile

import torch

import gpusnap
from gpusnap.storage.fast_tier import FastTier


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=600, help="64 KiB tensors in the state (one run each)")
    ap.add_argument("--saves", type=int, default=4)
    args = ap.parse_args()
    FastTier.check_bytes = lambda *a, **k: None  # (probe only: see above)
    state = {f"t{i}": torch.randn(16384) for i in range(args.tensors)}
    root = tempfile.mkdtemp(prefix="gpusnap-collector-")
    moved: list[collections.Counter] = []
    before: set[int] = set()

    def on_collection(phase: str, info: dict) -> None:
        nonlocal before
        if info["generation"] != 1:
            return
        if phase == "start":
            before = {id(o) for o in gc.get_objects(generation=2)}
        else:
            moved.append(collections.Counter(type(o).__name__ for o in gc.get_objects(generation=2)
                                             if id(o) not in before))

    try:
        with gpusnap.Checkpointer(root, keep_last=1) as ck:
            ck.save(state).wait()
            ck.wait()
            for i in range(args.saves):
                for t in state.values():
                    t.add_(1)
                gc.collect()
                moved.clear()
                gc.callbacks.append(on_collection)
                try:
                    ck.save(state).wait()
                    ck.wait()  # (durable: the promotion is over)
                finally:
                    gc.callbacks.remove(on_collection)
                total = sum(sum(m.values()) for m in moved)
                top = sum(moved, collections.Counter()).most_common(6)
                print(f"save {i}: {len(moved)} generation-1 collections moved {total} objects into the oldest: {top}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
