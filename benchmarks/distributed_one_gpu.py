"""Collective checkpoints with two ranks sharing one GPU (issue 25, item 5).

    python benchmarks/distributed_one_gpu.py [--device cuda|cpu] [--size MIB] [--out DIR] [--root DIR]
                                             [--variants ddp fsdp2 reshard kill] [--timeout S]

NCCL refuses two ranks on one GPU, so the ranks (fresh interpreters, ``distributed_one_gpu_
ranks.py``) join gloo through a TCPStore this launcher holds (``MASTER_ADDR=127.0.0.1``, a free
port), and with ``--device cuda`` both put their tensors on ``cuda:0``. With ``--gpus 2`` (a
machine of two GPUs) rank ``r`` runs on ``cuda:r`` and the group is ``cpu:gloo,cuda:nccl``. Variants, each run and
reported even if another fails:

- ``ddp`` (a): DDP training of a transformer-ish MLP stack (``--size`` MiB of parameters per
  rank, AdamW adds twice that; fused AdamW on CUDA), a collective Checkpointer saving every
  ``--every`` steps while training goes on; every save restored on both ranks into fresh state
  and compared bit-exactly with a clone taken at the save; a resume from the middle save must
  reproduce the uninterrupted run bit-exactly (RNG included).
- ``fsdp2`` (b): the same with ``fully_shard`` over the 2 ranks. If it fails (gloo may lack a
  collective FSDP2 needs on CUDA tensors), ``dtensor`` runs instead: parameters made DTensors
  with ``distribute_tensor`` (Shard(0) weights, Replicate biases), same checks.
- ``reshard`` (c): one process without a process group restores the last 2-rank save of b into
  the unsharded model on the device, and ``gpusnap.load`` assembles full tensors; both compared
  with the full tensors cut from the ranks' local shards at the save.
- ``kill`` (d): a rank SIGKILLed during its chunk writes (``--victims``, each a run): nothing
  committed, the other rank's ``wait()`` raises within ``Config.collective_timeout_s``
  (``--kill-timeout``), the previous save restores.
- costs (e, measured in a and b): per save, the time inside ``save()`` spent coordinating,
  ``save()``'s stall, the writer's coordination, and the step's extra time (the step with the
  save minus the median plain step; and the extra of the steps while the save was in flight).

Each variant's ranks are killed after ``--timeout`` seconds and it is reported as a hang. Logs
and per-rank JSON go to ``--out`` (``VARIANT-RANK.log`` holds each rank's output and any
traceback); a table is printed last. Checkpoints go under ``--root`` (default: a fresh
directory under /tmp), removed at the end unless ``--keep``; nothing is written to /dev/shm.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RANKS = str(Path(__file__).with_name("distributed_one_gpu_ranks.py"))
SRC = str(Path(__file__).resolve().parent.parent / "src")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--gpus", type=int, default=1,
                   help="GPUs the ranks spread over: 1 (both on cuda:0, gloo) or 2 (rank r on cuda:r, "
                        "process group cpu:gloo,cuda:nccl)")
    p.add_argument("--size", type=float, default=None, help="MiB of parameters per model (default: 192 cuda, 2 cpu)")
    p.add_argument("--width", type=int, default=None, help="model width (default: 1024 cuda, 64 cpu)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=None, help="tokens per sample (default: 256 cuda, 8 cpu)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--every", type=int, default=5, help="save every K steps")
    p.add_argument("--plain-steps", type=int, default=6, help="steps timed without a save (the baseline)")
    p.add_argument("--variants", nargs="+", default=["ddp", "fsdp2", "reshard", "kill"],
                   choices=["ddp", "fsdp2", "dtensor", "reshard", "kill"])
    p.add_argument("--victims", type=int, nargs="+", default=[1, 0], help="ranks SIGKILLed in variant kill")
    p.add_argument("--kill-timeout", type=int, default=20, help="Config.collective_timeout_s of variant kill")
    p.add_argument("--collective-timeout", type=int, default=60, help="Config.collective_timeout_s elsewhere")
    p.add_argument("--timeout", type=float, default=120.0, help="a variant's wall time before it counts as a hang")
    p.add_argument("--no-fsync", action="store_true")
    p.add_argument("--out", default=None, help="logs and results (default: a new directory under /tmp, kept)")
    p.add_argument("--root", default=None, help="checkpoint roots (default: a new directory under /tmp, removed)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint roots")
    args = p.parse_args()
    cuda = args.device == "cuda"
    args.size = args.size if args.size is not None else (192.0 if cuda else 2.0)
    args.width = args.width or (1024 if cuda else 64)
    args.seq = args.seq or (256 if cuda else 8)
    return args


def free_store() -> Any:
    """The ranks' TCPStore, held here so that a rank's death does not take it down."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)


def run_ranks(variant: str, world: int, label: str, rank_args: dict[str, Any], out: Path, root: Path,
              timeout: float) -> tuple[list[dict[str, Any]], dict[int, int], bool, float]:
    """Start ``world`` ranks of ``variant``; returns their result documents, exit codes, whether
    the watchdog killed them (a hang), and the wall time."""
    store = free_store() if world > 1 else None
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port if store else 0),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"),
               CUBLAS_WORKSPACE_CONFIG=":4096:8",
               PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH", "")) if p))
    args = dict(rank_args, hang_s=max(5.0, timeout - 10))
    started = time.perf_counter()
    procs, logs = [], []
    for rank in range(world):
        log = open(out / f"{label}-{rank}.log", "wb")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, RANKS, variant, str(rank), str(world), str(out), str(root),
                                       json.dumps(args)], stdout=log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True))
    hung = False
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
            break
    if hung:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in procs:
            proc.wait()
    for log in logs:
        log.close()
    wall = time.perf_counter() - started
    docs = []
    for rank in range(world):
        path = out / f"{variant}-{rank}.json"
        if path.exists():
            doc = json.loads(path.read_text())
            path.rename(out / f"{label}-{rank}.json")
            docs.append(doc)
    return docs, {r: p.returncode for r, p in enumerate(procs)}, hung, wall


def verdict(docs: list[dict[str, Any]], codes: dict[int, int], hung: bool, world: int,
            killed: tuple[int, ...] = ()) -> str:
    """"ok", "hang", or the first problem: a rank's error, a failed check, an unexpected exit."""
    if hung:
        return "hang (ranks killed by the watchdog)"
    for doc in docs:
        if doc["error"]:
            return f"ERROR rank {doc['rank']}: {doc['error']}"
        bad = [f"{k}: {v}" for k, v in doc["checks"].items() if v != "ok"]
        if bad:
            return f"FAIL rank {doc['rank']}: {bad[0]}"
    for rank, code in codes.items():
        want = -signal.SIGKILL if rank in killed else 0
        if code != want:
            return f"FAIL rank {rank} exited {code} (expected {want})"
    if len(docs) != world - len(killed):
        return f"FAIL {world - len(killed) - len(docs)} rank(s) left no result"
    return "ok"


def key_numbers(docs: list[dict[str, Any]]) -> str:
    """The numbers a row shows (the maximum over ranks)."""
    nums = [d["numbers"] for d in docs]
    if not nums:
        return ""

    def worst(key: str) -> Any:
        values = [n[key] for n in nums if n.get(key) is not None]
        return max(values) if values else None

    shown = []
    for key, fmt in (("state_mib", "state {:g} MiB/rank"), ("plain_step_ms", "step {:.1f} ms"),
                     ("median_coordinate_ms", "in save() coordination {:.3f} ms"),
                     ("median_stall_ms", "stall {:.1f} ms"), ("median_step_extra_ms", "save step +{:.1f} ms"),
                     ("median_in_flight_extra_ms", "in flight +{:.1f} ms"),
                     ("median_writer_coordination_ms", "writer coordination {:.1f} ms"),
                     ("restore_s", "restore {:.2f} s"), ("load_s", "load {:.2f} s"),
                     ("raised_after_kill_s", "raised {:.2f} s after the kill")):
        value = worst(key)
        if value is not None:
            shown.append(fmt.format(value))
    return ", ".join(shown)


def main() -> None:
    args = parse()
    out = Path(args.out or tempfile.mkdtemp(prefix="gpusnap-dist1gpu-out-", dir="/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    made_root = args.root is None
    root_base = Path(args.root or tempfile.mkdtemp(prefix="gpusnap-dist1gpu-", dir="/tmp"))
    if os.path.realpath(root_base).startswith("/dev/shm"):
        raise SystemExit("--root must not be under /dev/shm")
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    rank_args = {"device": args.device, "gpus": args.gpus, "size_mib": args.size, "width": args.width, "batch": args.batch,
                 "seq": args.seq, "steps": args.steps, "every": args.every,
                 "plain_steps": args.plain_steps, "fsync": not args.no_fsync,
                 "collective_timeout_s": args.collective_timeout, "kill_timeout_s": args.kill_timeout}
    print(f"# out {out}, roots {root_base}, device {args.device}, {args.size:g} MiB of parameters, width "
          f"{args.width}", flush=True)
    rows: list[tuple[str, str, str]] = []
    sharded: list[str] = []  # the variants whose 2-rank saves variant reshard reads

    def run(variant: str, label: str, world: int, extra: dict[str, Any] | None = None,
            killed: tuple[int, ...] = ()) -> str:
        root = root_base / label
        started = time.perf_counter()
        try:
            docs, codes, hung, wall = run_ranks(variant, world, label, {**rank_args, **(extra or {})}, out, root,
                                                args.timeout)
            result = verdict(docs, codes, hung, world, killed)
            numbers = key_numbers(docs)
            notes = sorted({n[:140] for d in docs for n in d["notes"]})
        except Exception as exc:  # (the launcher's own failure: reported, the next variant goes on)
            wall, result, numbers, notes = time.perf_counter() - started, f"ERROR launcher: {exc}", "", []
        rows.append((label, result, f"{numbers}{', ' if numbers else ''}{wall:.0f} s wall"))
        print(f"{label}: {result}  [{rows[-1][2]}]", flush=True)
        for note in notes:
            print(f"  note: {note}", flush=True)
        if result != "ok":
            print(f"  logs: {out}/{label}-*.log", flush=True)
        return result

    try:
        for variant in args.variants:
            if variant in ("ddp", "fsdp2", "dtensor"):
                result = run(variant, variant, 2)
                if variant == "fsdp2" and result != "ok" and "dtensor" not in args.variants:
                    print("fsdp2 failed: falling back to DTensor state made with distribute_tensor", flush=True)
                    result = run("dtensor", "dtensor", 2)
                    variant = "dtensor"
                if variant != "ddp" and result == "ok":
                    sharded.append(variant)
            elif variant == "reshard":
                if not sharded:
                    rows.append(("reshard", "skipped: no 2-rank sharded save (fsdp2 and dtensor failed or not run)", ""))
                    print(f"reshard: {rows[-1][1]}", flush=True)
                last = f"step{args.steps - args.steps % args.every}"
                for source in sharded:
                    run("reshard", f"reshard-{source}", 1, {"source": source, "tag": last,
                                                            "root_of": str(root_base / source)})
            elif variant == "kill":
                for victim in args.victims:
                    chunk = random.Random(victim).randrange(4)
                    (out / f"kill-moment-{victim}").unlink(missing_ok=True)  # (the victim writes it)
                    run("kill", f"kill-rank{victim}", 2, {"victim": victim, "chunk": chunk}, killed=(victim,))
    finally:
        if made_root and not args.keep:
            shutil.rmtree(root_base, ignore_errors=True)
        shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
        if shm_after - shm_before:  # (another process may have made them: their names say)
            rows.append(("/dev/shm", f"FAIL new entries: {sorted(shm_after - shm_before)[:5]}", ""))
    (out / "summary.json").write_text(json.dumps([{"variant": v, "result": r, "numbers": n} for v, r, n in rows],
                                                 indent=1))
    width = max(len(v) for v, _r, _n in rows) if rows else 8
    print(f"\n{'variant':<{width}}  result / key numbers (max over ranks; device {args.device})")
    for v, r, n in rows:
        print(f"{v:<{width}}  {r}")
        if n:
            print(f"{'':<{width}}    {n}")
    print(f"# logs and JSON: {out}")
    sys.exit(0 if all(r == "ok" for _v, r, _n in rows) else 1)


if __name__ == "__main__":
    main()
