"""What a collective checkpoint costs FSDP2 training, against DCP in the same run (issue 26).

    python benchmarks/distributed_cost.py [--gpus 2] [--workload llama|gpt2-large] [--size quick|tiny] [--saves 3] [--window 20]
                                          [--systems gpusnap dcp_async dcp_save] [--out DIR] [--root DIR]

One process per rank (this file, started again with ``--rank``): rank ``r`` trains the bench's
Llama-style model (``gpusnap.bench.llama``: 0.95B with ``--size quick``) or GPT-2 large
(``--workload gpt2-large``), bf16 autocast, fused AdamW, under ``fully_shard`` (each block,
then the whole model) on ``cuda:r``
(``--gpus 1``: every rank on ``cuda:0``), the process group ``cpu:gloo,cuda:nccl`` (gloo alone
on one GPU or the CPU). NVLink multicast stays as the environment sets it (``NCCL_NVLS_ENABLE``).

Each system saves ``--saves`` times while training; each save is charged as
``gpusnap bench --cost`` charges it (``src/gpusnap/bench/cost.py``): a window of at least
``--window`` steps that runs on until the save is durable *on every rank* (the ranks agree
each step through a gloo group, plain windows too, so they run the same steps), against the
mean step of the plain windows just before and after it; host CPU-seconds likewise (summed
over the ranks), and the bytes under the system's root after each save (retention included;
DCP keeps its latest save only: tmpfs is memory). The first rank to fail ends the run. Systems:

- ``gpusnap``: a collective ``gpusnap.Checkpointer`` (durable root; no fast tier for a
  collective Checkpointer yet), ``pending.done()`` for durable;
- ``dcp_async``: ``torch.distributed.checkpoint.async_save`` of the model's and optimizer's
  sharded state dicts (``get_model_state_dict``/``get_optimizer_state_dict``), its future, on
  a gloo group of its own (its writer thread's collectives must not meet FSDP's);
- ``dcp_save``: ``dcp.save``, blocking.

The first save of each system is restored into a fresh sharded model and optimizer on every
rank (gpusnap: ``restore``; DCP: ``dcp.load``) and compared bit-exactly with a clone taken at
the save. The launcher prints one table last (max over ranks); JSON per rank in ``--out``.
Resharding 2 -> 1 and a rank killed mid-save: ``benchmarks/distributed_one_gpu.py --gpus 2``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

SRC = str(Path(__file__).resolve().parent.parent / "src")


# -- one rank -----------------------------------------------------------------------------------
def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from distributed_one_gpu_ranks import differences, snapshot

    import gpusnap
    from gpusnap.bench.cost import Window, charge, pooled
    from gpusnap.bench.system import dir_bytes

    rank, world = args.rank, args.world
    cuda = args.device == "cuda"
    device = torch.device(f"cuda:{rank % args.gpus}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", args.port, world, is_master=False, timeout=timedelta(seconds=args.timeout))
    backend = "cpu:gloo,cuda:nccl" if cuda and args.gpus > 1 else "gloo"
    # a collective stuck on a dead peer fails after this, well inside the launcher's watchdog
    collective = timedelta(seconds=min(120.0, args.timeout / 3))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=collective)
    agree = dist.new_group(backend="gloo", timeout=collective)  # the per-step "durable everywhere?" flag
    # DCP's own group: async_save's background thread runs collectives while training runs
    # FSDP's on the default group (one group for both: a collective mismatch), as DCP advises
    dcp_group = dist.new_group(backend="gloo", timeout=collective)
    out, root = Path(args.out), Path(args.root)
    doc: dict[str, Any] = {"rank": rank, "device": str(device), "backend": backend, "systems": {}, "checks": {},
                           "error": None}

    def model_and_optim(seed: int) -> tuple[Any, Any, Any, Any]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(seed)  # every rank builds the same model, then keeps its shards
        if args.workload == "llama":
            from gpusnap.bench.llama import build_llama

            model, loss, _optim, data, _impl, config = build_llama(device, args.size, None, None)
            blocks = getattr(getattr(model, "model", model), "layers", [])
        else:
            model, loss, data, config = build_gpt2(args.workload, args.size, device)
            blocks = model.transformer.h
        mesh = init_device_mesh(device.type, (world,))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
        doc["config"] = config
        return model, loss, optim, data

    model, loss, optim, data = model_and_optim(0)
    state: dict[str, Any] = {"model": model, "optim": optim, "step": 0}
    torch.manual_seed(1000 + rank)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            out_loss = loss(data)
        out_loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        state["step"] += 1
        out_loss.detach().reshape(-1)[0].item()  # a loop reads its loss

    def everywhere(*flags: bool) -> list[bool]:
        """Each flag AND-ed over the ranks (one small gloo all_reduce, plain steps too)."""
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=agree)
        return [bool(v) for v in t.tolist()]

    def plain(n: int) -> Window:
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            step()
            everywhere(True, True)
        return Window(n, time.perf_counter() - w0, time.process_time() - c0)

    def dcp_state() -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}

    def restore_check(system: str, sroot: Path, index: int, expected: dict[str, Any], ck: Any, saved: Any) -> str:
        """Save ``index`` restored into a fresh sharded model and optimizer: "ok" or what differs."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)

        fresh, _loss, fresh_optim, _data = model_and_optim(7)
        target: dict[str, Any] = {"model": fresh, "optim": fresh_optim, "step": -1}
        if system == "gpusnap":
            ck.restore(target, checkpoint=saved)  # (the collective Checkpointer that saved it)
            want = expected
        else:
            sd = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_optim)}
            dcp.load(sd, checkpoint_id=str(sroot / f"save{index}"), process_group=dcp_group)
            set_model_state_dict(fresh, sd["model"])
            set_optimizer_state_dict(fresh, fresh_optim, sd["optim"])
            want = {k: v for k, v in expected.items() if k.startswith(("model.", "optim."))}
        got = {k: v for k, v in snapshot(target).items() if k in want or k.startswith(("model.", "optim."))}
        return differences(got, want) or "ok"

    for _ in range(3):
        step()  # warm-up
    if os.environ.get("GPUSNAP_DISTCOST_FAIL_RANK") == str(rank):  # (the tests: a rank that fails)
        raise RuntimeError("this rank was told to fail")
    for system in args.systems:
        import torch.distributed.checkpoint as dcp

        sroot = root / system
        ck = gpusnap.Checkpointer(sroot, keep_last=2, config=gpusnap.Config(fsync=True)) if system == "gpusnap" else None
        rows = []
        before = plain(args.window)
        try:
            for i in range(args.saves):
                expected = snapshot(state) if i == 0 else None
                dist.barrier()
                w0, c0 = time.perf_counter(), time.process_time()
                if system == "gpusnap":
                    pending = ck.save(state)  # type: ignore[union-attr]
                    done = pending.done
                elif system == "dcp_async":
                    future = dcp.async_save(dcp_state(), checkpoint_id=str(sroot / f"save{i}"), process_group=dcp_group)
                    done = future.done
                else:
                    dcp.save(dcp_state(), checkpoint_id=str(sroot / f"save{i}"), process_group=dcp_group)
                    done = lambda: True  # noqa: E731
                call = time.perf_counter() - w0
                steps, durable_at = 0, None
                while True:
                    step()
                    steps += 1
                    durable, within = everywhere(done(), time.perf_counter() - w0 < args.max_window_s)
                    if durable and durable_at is None:
                        durable_at = time.perf_counter() - w0
                    if durable_at is not None and steps >= args.window:
                        break
                    if not within and durable_at is None:
                        raise RuntimeError(f"{system} save {i} not durable on every rank within {args.max_window_s} s")
                window = Window(steps, time.perf_counter() - w0, time.process_time() - c0)
                saved = None
                if system == "gpusnap":
                    saved = pending.wait().id
                elif system == "dcp_async":
                    future.result()
                after = plain(args.window)
                both = pooled(before, after)
                cost, cpu_cost = charge(window, both)
                rows.append({"save": i, "cost_s": cost, "cpu_cost_s": cpu_cost, "call_s": call, "steps": steps,
                             "durable_s": durable_at, "root_bytes": dir_bytes(str(sroot)) if rank == 0 else None,
                             "drift_s": steps * (after.step_wall_s - before.step_wall_s),
                             "step_s": both.step_wall_s})
                print(f"rank {rank} {system} save {i}: cost {cost * 1e3:.1f} ms, CPU {cpu_cost:.2f} s, "
                      f"call {call * 1e3:.1f} ms, durable {durable_at:.2f} s", flush=True)
                before = after
                if expected is not None:
                    doc["checks"][f"{system} save 0 bit-exact"] = restore_check(system, sroot, i, expected, ck, saved)
                    for _ in range(2):
                        step()  # (the check's tail settles)
                    before = plain(args.window)  # not charged to the next save
                if system != "gpusnap" and i > 0:  # keep one DCP save: tmpfs is memory
                    dist.barrier()
                    if rank == 0:
                        shutil.rmtree(sroot / f"save{i - 1}", ignore_errors=True)
        finally:
            if ck is not None:
                ck.close()
        doc["systems"][system] = rows
        dist.barrier()
        if rank == 0:  # each system's root goes once its row is done
            shutil.rmtree(sroot, ignore_errors=True)
    (out / f"rank{rank}.json").write_text(json.dumps(doc, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()


def build_gpt2(name: str, size: str, device: Any) -> tuple[Any, Any, Any, dict[str, Any]]:
    """The bench's GPT-2 shapes (``gpusnap.bench.workloads``), as (model, loss, data, config)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpusnap.bench.workloads import _GPT, _GPT_VOCAB

    n_layer, n_embd, n_head, b, seq = _GPT[name][size]
    vocab = _GPT_VOCAB[size]
    with torch.device(device):
        model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                                           n_positions=max(1024, seq), vocab_size=vocab))
        data = torch.randint(0, vocab, (b, seq))
    model.train()

    def loss(tokens: Any) -> Any:
        return model(input_ids=tokens, labels=tokens).loss

    return model, loss, data, {"n_layer": n_layer, "n_embd": n_embd, "batch": b, "seq": seq, "size": size}


# -- the launcher -------------------------------------------------------------------------------
def launch(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    out = Path(args.out or tempfile.mkdtemp(prefix="gpusnap-distcost-out-", dir="/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    root = Path(args.root or tempfile.mkdtemp(prefix="gpusnap-distcost-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH", "")) if p))
    common = ["--world", str(args.world), "--port", str(store.port), "--out", str(out), "--root", str(root),
              "--device", args.device, "--gpus", str(args.gpus), "--workload", args.workload, "--size", args.size, "--saves", str(args.saves),
              "--window", str(args.window), "--timeout", str(args.timeout), "--max-window-s", str(args.max_window_s), "--systems", *args.systems]
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), *common], env=env,
                              stdout=open(out / f"rank{r}.log", "wb"), stderr=subprocess.STDOUT)
             for r in range(args.world)]
    deadline, hung = time.monotonic() + args.timeout, False
    while any(p.poll() is None for p in procs):  # the first rank to fail ends the run (its peer would wait)
        hung = time.monotonic() > deadline
        if hung or any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.5)
    codes = [p.wait() for p in procs]
    shutil.rmtree(root, ignore_errors=True)
    docs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.world) if (out / f"rank{r}.json").exists()]
    print(f"\n# {args.world} ranks on {args.gpus} GPU(s), {args.device}; exit codes {codes}"
          f"{' (the watchdog killed them)' if hung else ''}; logs in {out}")
    errors = {d["rank"]: d["error"] for d in docs if d.get("error")}
    if errors or len(docs) != args.world:
        print(f"FAIL: errors {errors}; {args.world - len(docs)} rank(s) left no result (see their logs)")
        return 1
    checks = {k: v for d in docs for k, v in d["checks"].items() if v != "ok"}
    print("| system | cost / save (median; max over ranks) | CPU-s / save (all ranks) | save() call | durable "
          "| GB on disk after a save | plain-step drift (largest) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    medians: dict[str, float] = {}
    for system in args.systems:
        per_rank = [d["systems"].get(system, []) for d in docs]
        if not all(per_rank):
            print(f"| {system} | not run | | | | | |")
            continue

        def worst(key: str) -> float:
            return max(statistics.median(r[key] for r in rows) for rows in per_rank)

        medians[system] = worst("cost_s")
        cpu = sum(statistics.median(r["cpu_cost_s"] for r in rows) for rows in per_rank)
        gb = statistics.median(r["root_bytes"] for r in per_rank[0]) / 1e9  # (rank 0 counts the root)
        drift = max((r["drift_s"] for rows in per_rank for r in rows), key=abs)
        print(f"| {system} | {worst('cost_s') * 1e3:.1f} ms | {cpu:.2f} | {worst('call_s') * 1e3:.1f} ms "
              f"| {worst('durable_s'):.2f} s | {gb:.2f} | {drift * 1e3:+.1f} ms |")
    if "gpusnap" in medians and "dcp_async" in medians and medians["gpusnap"] > 0:
        print(f"dcp_async / gpusnap cost: {medians['dcp_async'] / medians['gpusnap']:.1f}x")
    print("bit-exact: " + ("all checks ok" if not checks else f"FAILED {checks}"))
    return 0 if not checks and all(c == 0 for c in codes) else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--gpus", type=int, default=2, help="GPUs the ranks spread over (1: all on cuda:0, gloo)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--workload", default="llama", choices=("llama", "gpt2-large"))
    p.add_argument("--size", default="quick", choices=("quick", "tiny"))
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--systems", nargs="+", default=["gpusnap", "dcp_async", "dcp_save"],
                   choices=["gpusnap", "dcp_async", "dcp_save"])
    p.add_argument("--timeout", type=float, default=540.0, help="the whole run's watchdog (s)")
    p.add_argument("--max-window-s", type=float, default=120.0, help="a save not durable by then fails the run")
    p.add_argument("--out", default=None)
    p.add_argument("--root", default=None)
    args = p.parse_args()
    if args.rank is not None:
        try:
            rank_main(args)
        except BaseException as exc:  # recorded, then out at once: a peer may sit in a collective
            traceback.print_exc()
            (Path(args.out) / f"rank{args.rank}.json").write_text(json.dumps(
                {"rank": args.rank, "error": f"{type(exc).__name__}: {exc}"[:400], "systems": {}, "checks": {}}))
            sys.stdout.flush()
            os._exit(1)
        return
    sys.exit(launch(args))


if __name__ == "__main__":
    main()
