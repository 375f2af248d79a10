"""Cold start in a *fresh process*: what a serving process that starts from nothing pays
before its first logits (issue 5), which a cold start in a process that has already restored
does not see (CUDA, Triton's kernels and the reader processes are warm there).

The parent saves a model once (``restore_models.py``'s models, random weights, a forward inside
the save window so the manifest records the access order). Then, per run, a new Python
process imports torch and gpusnap, builds the model and produces the first logits, through
one of:

- ``lazy``: ``gpusnap.cold_start`` (empty model, lazy restore), then the forward;
- ``eager``: ``gpusnap.empty_model``, ``ckpt.restore``, then the forward;
- ``eager-off``: the same with ``verify="off"`` (no hash kernels: what compiling or loading
  them costs the first restore of a process);
- a ``-nowarm`` suffix: without loading the hash kernels beside the restore's set-up
  (``restore/pipeline/warmup.py``).

Runs alternate kinds. Triton's on-disk cache is shared by the runs (warm after the first
that compiles; the parent's save already compiles the save-side hash kernel) unless
``--fresh-triton-cache`` gives each run an empty one, as on a machine's very first start. Each child prints its phases from the moment its interpreter started:
imports, CUDA context, build, restore (returned / done), first logits.

Run: ``PYTHONPATH=src python3 benchmarks/fresh_cold_start.py [--model gpt2-large] [--rounds 2]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

CHILD = r"""
import json, os, sys, time
t0 = float(sys.argv[4])
marks = {}
def mark(name):
    marks[name] = time.time() - t0
import torch
import gpusnap
sys.path.insert(0, os.path.dirname(sys.argv[5]))
import restore_models as rb
spec = next(s for s in rb.FULL + rb.TINY if s.name == sys.argv[2])
build, _ = rb.builder(spec)  # (imports transformers' model code: an import, not the build)
mark("imports")
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if dev.type == "cuda":
    torch.cuda.init(); torch.empty(1, device=dev)
mark("cuda_init")
ids = torch.arange(64, device=dev).unsqueeze(0) % 50257
kind = sys.argv[3]
if kind.endswith("-nowarm"):  # without loading the hash kernels beside the set-up (restore/pipeline/warmup.py)
    import gpusnap.restore.pipeline.warmup as warmup
    warmup.WARM_KERNELS = False
    kind = kind[: -len("-nowarm")]
with gpusnap.Checkpointer(sys.argv[1], config=gpusnap.Config.from_env(fsync=False)) as ck:
    if kind == "lazy":
        model, handle = gpusnap.cold_start(build, ck, device=dev)
        mark("restore_returned")
        mark("built")  # (inside cold_start; see restore_s)
    else:
        model = gpusnap.empty_model(build, dev)
        rb.sync(dev); mark("built")
        handle = ck.restore({"model": model}, verify="off" if kind == "eager-off" else "auto")
        mark("restore_returned")
    out = rb.logits(model, ids)
    rb.sync(dev); mark("first_logits")
    handle.wait(); mark("restore_done")
    stats = {k: handle.stats.get(k) for k in ("return_s", "total_s", "waits", "wait_s", "verify_path", "reader_procs",
                                              "setup", "first_check_s")}
print("RESULT " + json.dumps({"kind": sys.argv[3], "marks": marks, "stats": stats,
                              "checksum": float(out.float().sum())}), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-large", help="one of restore_models.py's models (FULL or TINY)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kinds", default="lazy,eager,eager-off")
    ap.add_argument("--out", default="fresh_cold_start.json")
    ap.add_argument("--fresh-triton-cache", action="store_true",
                    help="each child gets an empty TRITON_CACHE_DIR (a machine's very first start; "
                         "otherwise the parent's save has already compiled the save-side hash kernel)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import restore_models as rb
    import torch

    import gpusnap

    names = [s.name for s in rb.FULL + rb.TINY]
    if args.model not in names:
        ap.error(f"--model must be one of {', '.join(names)}, not {args.model!r}")
    kinds = {"lazy", "eager", "eager-off"}
    bad = [k for k in args.kinds.split(",") if k.removesuffix("-p32").removesuffix("-nowarm") not in kinds]
    if bad:
        ap.error(f"--kinds: unknown {', '.join(bad)} (lazy, eager, eager-off, each optionally -nowarm, "
                 f"then optionally -p32: 32 MiB restore pieces, the default before the thirteenth session)")

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = next(s for s in rb.FULL + rb.TINY if s.name == args.model)
    build, impl = rb.builder(spec)
    root = rb.pick_root(4 << 30 if dev.type == "cuda" else 1 << 28, None)
    ck_dir = os.path.join(root, "gpusnap")
    try:
        torch.manual_seed(0)
        with torch.device(dev):
            model = build()
        ids = torch.arange(64, device=dev).unsqueeze(0) % 50257
        expected = float(rb.logits(model, ids).float().sum())
        with gpusnap.Checkpointer(ck_dir, config=gpusnap.Config.from_env(fsync=False)) as ck:
            rb.save_while_serving(ck, model, ids)
        nbytes = rb.nbytes_of(model)
        del model
        print(f"{spec.name} ({impl}): {nbytes / 1e9:.2f} GB saved under {root}", flush=True)
        runs = []
        for r in range(args.rounds):
            for kind in args.kinds.split(","):
                env = dict(os.environ)
                if kind.endswith("-p32"):
                    env["GPUSNAP_RESTORE_PIECE_BYTES"] = str(32 << 20)
                if args.fresh_triton_cache:
                    env["TRITON_CACHE_DIR"] = os.path.join(root, f"triton-{r}-{kind}")
                started = time.time()
                proc = subprocess.run([sys.executable, "-c", CHILD, ck_dir, spec.name, kind.removesuffix("-p32"),
                                       repr(started),
                                       os.path.abspath(__file__)], capture_output=True, text=True, timeout=300,
                                      env=env, check=False)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode or not lines:
                    print(f"round {r} {kind}: failed ({proc.returncode})\n{proc.stderr[-2000:]}", flush=True)
                    continue
                res = json.loads(lines[-1][7:])
                res.update(kind=kind, round=r, wall_s=time.time() - started, match=abs(res["checksum"] - expected) < 1e-3 * max(1.0, abs(expected)))
                runs.append(res)
                m = res["marks"]
                print(f"round {r} {kind:9s}: imports {m['imports']:.2f} s, CUDA {m['cuda_init'] - m['imports']:.2f} s, "
                      f"build+restore to first logits {m['first_logits'] - m['cuda_init']:.3f} s "
                      f"(restore() returned at {m['restore_returned'] - m['cuda_init']:.3f} s, all loaded at "
                      f"{m['restore_done'] - m['cuda_init']:.3f} s), first logits at {m['first_logits']:.2f} s "
                      f"from interpreter start; stats {res['stats']}; logits match {res['match']}", flush=True)
        with open(args.out, "w") as fh:
            json.dump({"model": spec.name, "bytes": nbytes, "device": str(dev), "runs": runs}, fh, indent=2)
        print("\nkind | round | from CUDA ready to first logits s | restore() returned s | first logits from start s")
        for res in runs:
            m = res["marks"]
            print(f"{res['kind']} | {res['round']} | {m['first_logits'] - m['cuda_init']:.3f} | "
                  f"{m['restore_returned'] - m['cuda_init']:.3f} | {m['first_logits']:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
