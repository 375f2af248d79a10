"""Time to first logits with the warm process pool against fresh processes (issue 40).

The parent builds a Llama-style model from a ``transformers`` LlamaConfig (hidden 3072, 26
layers, 24 heads, 8 key/value heads, intermediate 8192, vocab 128256, bf16, ~3.2 B
parameters; ``--tiny``: a small one), computes its logits for a fixed prompt, saves it with
``save_pretrained`` and as a gpusnap checkpoint (a forward inside the save window), all on
``/dev/shm``, and starts ``gpusnap serve`` on the checkpoint. Then, in the same run:

- **fresh processes**, one per kind and round, timed from the parent's launch of the process
  (``launch``) and from the moment its CUDA context was ready (``cuda``) to its first logits:
  ``from_pretrained`` (safetensors, ``device_map``), ``cold_start`` (``gpusnap.cold_start``
  from the files, with ``warm_up=`` a forward of the prompt), ``served`` (the same, served by
  ``gpusnap serve``);
- **the pool**: ``gpusnap.pool.Pool(ck, "pool_start:serve", size=1)`` (this file is the entry
  module), restoring from the same server; timed from the ``pool.take()`` call to the first
  logits (the process was launched, imported, built and warmed before: its own start is
  reported beside, as ``start``), and inside the process from the take's arrival to the
  first logits (``weights``: the restore into the tensors it has, then the forward). Each
  round takes a process (the second round takes the replacement of the first).

Every run's logits are compared bit for bit with the source model's. The table comes last;
``--out`` gets the JSON. Everything put on ``/dev/shm`` is removed at the end, and the server
and pool stopped, on error too.

Run (GPU machine, repository root): ``PYTHONPATH=src python3 benchmarks/pool_start.py --out
pool_start.json`` (``--tiny --device cpu`` checks it on a CPU; ``--rounds``, ``--kinds``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cold_start_serve import ServeProc, build_model  # noqa: E402
from cold_start_serve import prepare as prepare_model  # noqa: E402

import gpusnap.pool  # noqa: E402

KINDS = ("from_pretrained", "cold_start", "served")
CHILD_TIMEOUT_S = 300
POOL_TIMEOUT_S = 300
WORK_ENV = "POOL_START_WORK"  # the pool's processes find the saved config, prompt and logits here


# -- the pool's entry (imported by the pool's processes as ``pool_start:serve``) ---------------

def _work() -> str:
    return os.environ[WORK_ENV]


def _build() -> Any:
    from transformers import LlamaConfig

    return build_model(LlamaConfig.from_json_file(os.path.join(_work(), "config.json")))


def _prompt(device: Any) -> Any:
    import torch

    return torch.load(os.path.join(_work(), "ids.pt")).to(device)


def _warm_up(model: Any) -> None:
    model(input_ids=_prompt(next(model.parameters()).device), use_cache=False)


@gpusnap.pool.entry(build=_build, warm_up=_warm_up)
def serve(ready: gpusnap.pool.Ready) -> dict[str, Any]:
    """One request: the prompt's logits, timed; then compared with the source model's."""
    import torch

    ids = _prompt(ready.device)
    with torch.no_grad():
        logits = ready.model(input_ids=ids, use_cache=False).logits
    if ready.device.type == "cuda":
        torch.cuda.synchronize(ready.device)
    first_at, first = time.time(), time.perf_counter()
    expected = torch.load(os.path.join(_work(), "expected.pt"))
    return {"first_logits_at": first_at, "weights_s": first - ready.asked_at,
            "restore_s": ready.loaded_at - ready.asked_at, "equal": bool(torch.equal(logits.cpu(), expected)),
            **{k: ready.stats.get(k) for k in ("source", "server_fallback", "served", "close_s")}}


# -- a fresh process (``pool_start.py --child KIND WORK DEVICE LAUNCHED``) -----------------------

def child(kind: str, work: str, device_name: str, launched: float) -> None:
    import torch
    from transformers import LlamaConfig

    import gpusnap
    from cold_start_serve_child import from_pretrained

    marks = {"imports": time.time() - launched}
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)
        torch.cuda.synchronize(device)
    marks["cuda_ready"] = time.time() - launched
    ids = torch.load(os.path.join(work, "ids.pt")).to(device)
    expected = torch.load(os.path.join(work, "expected.pt"))
    cfg = LlamaConfig.from_json_file(os.path.join(work, "config.json"))
    stats: dict[str, Any] = {}
    if kind == "from_pretrained":
        model = from_pretrained(work, device, stats)
        logits = _forward(model, ids, device)
    else:
        config = gpusnap.Config.from_env(fsync=False, warm_up_kernels=False,
                                         restore_from_server="on" if kind == "served" else "off")
        with gpusnap.Checkpointer(os.path.join(work, "ck"), config=config) as ck:
            model, handle = gpusnap.cold_start(lambda: build_model(cfg), ck, device=device,
                                               warm_up=lambda m: m(input_ids=ids, use_cache=False))
            logits = _forward(model, ids, device)
            marks["first_logits"] = time.time() - launched
            handle.wait()
            stats = {k: handle.stats.get(k) for k in ("source", "server_fallback", "mode", "warm_up", "warm_up_s",
                                                      "warm_up_waited_s", "served")}
    marks.setdefault("first_logits", time.time() - launched)
    print("RESULT " + json.dumps({"marks": marks, "stats": stats, "equal": bool(torch.equal(logits.cpu(), expected))},
                                 default=str), flush=True)


def _forward(model: Any, ids: Any, device: Any) -> Any:
    import torch

    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False).logits
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out


# -- the parent -------------------------------------------------------------------------------

def prepare(work: str, args: argparse.Namespace) -> int:
    """cold_start_serve.py's: build, expected logits, the Hugging Face directory and the root."""
    same = argparse.Namespace(small=args.tiny, device=args.device, prompt=args.prompt)
    return prepare_model(work, same, every_format=False)


def run_child(kind: str, r: int, work: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    launched = time.time()
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", kind, work, args.device,
                               repr(launched)], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env,
                              check=False)
        out, err, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, err, code = str(exc.stdout or ""), str(exc.stderr or ""), "timeout"
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if code != 0 or not lines:
        print(f"round {r} {kind}: FAILED (exit {code})\n{err[-2000:]}", flush=True)
        return {"kind": kind, "round": r, "failed": True, "exit": code, "stderr": err[-4000:]}
    res: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    m = res["marks"]
    res.update(kind=kind, round=r, launch_s=m["first_logits"], cuda_s=m["first_logits"] - m["cuda_ready"])
    print(f"round {r} {kind:15s}: launch -> first logits {res['launch_s']:.3f} s (imports {m['imports']:.2f} s, "
          f"CUDA ready at {m['cuda_ready']:.2f} s), CUDA ready -> first logits {res['cuda_s']:.3f} s, "
          f"equal {res['equal']}, source {res['stats'].get('source', '-')}", flush=True)
    return res


def run_pool(work: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    started = time.time()
    # (by name: this file runs as __main__ here, and is imported as pool_start there)
    with gpusnap.pool.Pool(os.path.join(work, "ck"), "pool_start:serve", size=1, device=args.device,
                           env={WORK_ENV: work}, config=gpusnap.Config.from_env(fsync=False, warm_up_kernels=False,
                                                          restore_from_server="on")) as pool:
        for r in range(args.rounds):
            pool.wait_ready(POOL_TIMEOUT_S)
            if r == 0:
                print(f"pool: a process ready {time.time() - started:.1f} s after the pool started", flush=True)
            asked = time.time()
            proc = pool.take(timeout=POOL_TIMEOUT_S)
            taken = time.time() - asked
            done = proc.wait(POOL_TIMEOUT_S)
            if done.returncode != 0:
                print(f"round {r} pool: FAILED ({done.error})", flush=True)
                runs.append({"kind": "pool", "round": r, "failed": True, "error": done.error})
                continue
            v = done.value
            stats = {k: v.get(k) for k in ("source", "server_fallback", "served", "close_s")}
            stats.update({k: proc.stats.get(k) for k in ("import_s", "cuda_s", "build_s", "warm_up_s")})
            res = {"kind": "pool", "round": r, "launch_s": v["first_logits_at"] - asked, "take_returned_s": taken,
                   "weights_s": v["weights_s"], "restore_s": v["restore_s"], "equal": v["equal"],
                   "start_s": proc.stats.get("start_s"), "stats": stats}
            res["cuda_s"] = res["launch_s"]  # (its CUDA context was ready before the request)
            runs.append(res)
            print(f"round {r} pool           : take() -> first logits {res['launch_s']:.3f} s (take returned "
                  f"{taken:.3f} s), weights -> first logits in the process {res['weights_s']:.3f} s (restore "
                  f"{res['restore_s']:.3f} s, source {v['source']}), equal {v['equal']}; the process's own start "
                  f"{res['start_s']:.1f} s (imports {proc.stats.get('import_s', 0):.1f}, build "
                  f"{proc.stats.get('build_s', 0):.2f}, warm-up {proc.stats.get('warm_up_s', 0):.2f})", flush=True)
    return runs


def table(runs: list[dict[str, Any]]) -> list[str]:
    rows = ["path | round | launch -> first logits s | CUDA ready -> first logits s | weights -> first logits s | "
            "logits bit-equal | source", "---|---:|---:|---:|---:|---|---"]
    for res in runs:
        if res.get("failed"):
            rows.append(f"{res['kind']} | {res['round']} | FAILED | - | - | - | -")
            continue
        weights = f"{res['weights_s']:.3f}" if "weights_s" in res else "-"
        name = "pool (from take())" if res["kind"] == "pool" else res["kind"]
        rows.append(f"{name} | {res['round']} | {res['launch_s']:.3f} | {res['cuda_s']:.3f} | {weights} | "
                    f"{res['equal']} | {res['stats'].get('source', '-')}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a small model (a quick check; runs on CPU)")
    ap.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kinds", default=",".join((*KINDS, "pool")), help=f"comma-separated, of {', '.join(KINDS)}, pool")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens of the first forward")
    ap.add_argument("--out", default="pool_start.json", help="the JSON results")
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in (*KINDS, "pool")]
    if bad or not kinds:
        ap.error(f"--kinds: unknown {', '.join(bad) or '(none given)'}; pick from {', '.join(KINDS)}, pool")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    work = tempfile.mkdtemp(prefix="gpusnap-pool-start-", dir=shm)
    runtime = os.path.join(work, "run")  # the server's socket: private to this run
    os.mkdir(runtime, 0o700)
    src = os.path.abspath(os.path.join(HERE, "..", "src"))
    # the memory tier off everywhere: nothing here saves twice, and /dev/shm keeps only the work directory
    os.environ.update(XDG_RUNTIME_DIR=runtime, GPUSNAP_MEMORY_TIER="off")  # (the pool finds the server through it)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, HERE, os.environ.get("PYTHONPATH", "")) if p)}
    server: ServeProc | None = None
    runs: list[dict[str, Any]] = []
    try:
        nbytes = prepare(work, args)
        if "served" in kinds or "pool" in kinds:
            started = time.perf_counter()
            server = ServeProc(work, env, args.device, f"{args.out}.server.log")
            ok = server.wait_ready()
            print(f"gpusnap serve: {'ready' if ok else 'NOT READY'} after {time.perf_counter() - started:.1f} s",
                  flush=True)
        for r in range(args.rounds):
            for kind in kinds:
                if kind != "pool":
                    runs.append(run_child(kind, r, work, args, env))
        if "pool" in kinds:
            runs.extend(run_pool(work, args))
        fp = min((r["launch_s"] for r in runs if r["kind"] == "from_pretrained" and not r.get("failed")), default=None)
        worst = max((r["launch_s"] for r in runs if r["kind"] == "pool" and not r.get("failed")), default=None)
        gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else None
        summary = {"device": args.device, "gpu": gpu, "bytes": nbytes, "tiny": args.tiny, "runs": runs,
                   "pool_vs_from_pretrained": (fp / worst) if fp and worst else None}
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2, default=str)
        print("\n" + "\n".join(table(runs)), flush=True)
        if summary["pool_vs_from_pretrained"]:
            print(f"\npool take() -> first logits: {summary['pool_vs_from_pretrained']:.1f}x below from_pretrained's "
                  "launch -> first logits (its best round against the pool's worst)", flush=True)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0 if runs and all(not r.get("failed") and r["equal"] for r in runs) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]))
    else:
        raise SystemExit(main())
