"""What one rank runs for ``distributed_one_gpu.py`` (the launcher starts it, a fresh
interpreter per rank):

    python distributed_one_gpu_ranks.py VARIANT RANK WORLD OUT ROOT ARGS_JSON

Ranks join gloo through the launcher's TCPStore (``MASTER_ADDR``/``MASTER_PORT``); with
``--device cuda`` every rank puts its tensors on ``cuda:0`` (NCCL refuses two ranks on one
GPU; gloo copies CUDA tensors through the host). A variant records its checks and numbers in
``OUT/VARIANT-RANK.json``; an exception is recorded there (its last line) and its traceback
printed to this rank's log (the launcher's ``OUT/VARIANT-RANK.log``).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gpusnap


class Report:
    """One rank's result: named checks ("ok" or what differs), numbers, notes."""

    def __init__(self, variant: str, rank: int) -> None:
        self.doc: dict[str, Any] = {"variant": variant, "rank": rank, "ok": False, "error": None,
                                    "checks": {}, "numbers": {}, "notes": []}

    def check(self, name: str, problem: str | None) -> None:
        self.doc["checks"][name] = "ok" if problem is None else problem
        print(f"check {name}: {'ok' if problem is None else problem}", flush=True)

    def number(self, name: str, value: Any) -> None:
        self.doc["numbers"][name] = value

    def note(self, text: str) -> None:
        self.doc["notes"].append(text)
        print(f"note: {text}", flush=True)

    def write(self, out: Path) -> None:
        self.doc["ok"] = self.doc["error"] is None and all(v == "ok" for v in self.doc["checks"].values())
        (out / f"{self.doc['variant']}-{self.doc['rank']}.json").write_text(json.dumps(self.doc, indent=1))


# -- the model and its training ---------------------------------------------------------------
class Block(nn.Module):
    """A transformer-ish MLP block: pre-norm, 4x expansion, dropout (draws from the device RNG)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(layers)))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def layers_for(args: dict[str, Any]) -> int:
    """Blocks so that the parameters take about ``size_mib`` (fp32; AdamW adds twice that)."""
    per_block = 8 * args["width"] ** 2 + 7 * args["width"]
    return max(1, round(args["size_mib"] * (1 << 20) / 4 / per_block))


def build_net(args: dict[str, Any], device: torch.device, seed: int) -> Net:
    torch.manual_seed(seed)  # every rank builds the same model
    return Net(args["width"], layers_for(args)).to(device)


def adamw(params: Any, device: torch.device, *, fused: bool = True) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=fused and device.type == "cuda")


def seed_ranks(rank: int) -> None:
    """Each rank draws its own batches (and dropout masks) from the global generators."""
    torch.manual_seed(1000 + rank)


def model_step(state: dict[str, Any], args: dict[str, Any], device: torch.device) -> None:
    """One optimizer step on a batch drawn from the global RNG (restored with the checkpoint)."""
    model, optim = state["model"], state["optim"]
    x = torch.randn(args["batch"], args["seq"], args["width"], device=device)
    target = torch.randn(args["batch"], args["seq"], args["width"], device=device)
    optim.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), target).backward()
    optim.step()
    state["step"] += 1


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- snapshots: what a checkpoint must hold, cloned at the save ---------------------------------
def local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """Clones of this rank's model, optimizer state, RNG states and plain values (a DTensor's
    local tensor), on their device: what restoring the save taken now must give back."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            out.update({f"{key}.{k}": local(v).detach().clone() for k, v in value.state_dict().items()})
        elif isinstance(value, torch.optim.Optimizer):
            sd = value.state_dict()
            for i, moments in sd["state"].items():
                out.update({f"{key}.{i}.{k}": local(v).detach().clone() if torch.is_tensor(v) else v
                            for k, v in moments.items()})
            out[f"{key}.groups"] = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
        elif isinstance(value, gpusnap.RNGState):
            out[f"{key}.torch"] = torch.get_rng_state()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                out[f"{key}.cuda"] = torch.cuda.get_rng_state()
        elif torch.is_tensor(value):
            out[key] = local(value).detach().clone()
        else:
            out[key] = value
    return out


def differences(got: dict[str, Any], want: dict[str, Any]) -> str | None:
    """None when every entry is bit-exactly equal, else the first keys that differ."""
    bad = sorted(set(got) ^ set(want))
    for key in sorted(set(got) & set(want)):
        a, b = got[key], want[key]
        if torch.is_tensor(a) or torch.is_tensor(b):
            same = (torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype
                    and torch.equal(a.cpu(), b.cpu()))
        else:
            same = a == b
        if not same:
            bad.append(key)
    return None if not bad else f"{len(bad)} entries differ: {', '.join(bad[:5])}"


# -- a training run with collective saves (variants ddp, fsdp2, dtensor) ------------------------
def train_and_check(rep: Report, make: Callable[[int], dict[str, Any]], step: Callable[[dict[str, Any]], None],
                    root: Path, args: dict[str, Any], device: torch.device, cfg: gpusnap.Config,
                    last_save: Callable[[dict[str, Any], str, dict[str, Any]], None] | None = None) -> None:
    """Train ``args["steps"]`` steps, saving every ``args["every"]`` concurrently; restore every
    save into fresh state and compare with its clone; resume from the middle save and compare
    with the uninterrupted run's end; record the saves' costs on the training step.
    ``last_save(state, tag, clone)`` is called once training is over, with the last save's clone."""
    state = make(0)
    seed_ranks(dist.get_rank())
    saves: list[tuple[str, dict[str, Any], Any, int]] = []  # tag, clone, pending, step index
    steps_s: list[float] = []
    save_call_s: dict[str, float] = {}
    done_at: dict[str, int] = {}  # tag -> the step at whose end its save was first seen done
    with gpusnap.Checkpointer(root, config=cfg) as ck:
        for n in range(1, args["steps"] + 1):
            sync(device)
            t0 = time.perf_counter()
            step(state)
            sync(device)
            took = time.perf_counter() - t0
            if n % args["every"] == 0:
                tag = f"step{n}"
                clone = snapshot(state)  # (before save(): nothing runs between the two)
                sync(device)
                t1 = time.perf_counter()
                pending = ck.save(state, tag=tag)
                sync(device)
                save_call_s[tag] = time.perf_counter() - t1
                took += save_call_s[tag]
                saves.append((tag, clone, pending, n - 1))
            steps_s.append(took)
            for tag, _c, pending, _i in saves:
                if tag not in done_at and pending.done():
                    done_at[tag] = n - 1
        final = snapshot(state)
        rep.number("state_mib", round(sum(t.numel() * t.element_size() for t in final.values()
                                          if torch.is_tensor(t)) / (1 << 20), 1))
        infos = {tag: pending.wait() for tag, _c, pending, _i in saves}
        if last_save is not None:
            last_save(state, saves[-1][0], saves[-1][1])
        plain = []  # steps with no save in flight (after the run compared against: they change nothing)
        for _ in range(args["plain_steps"]):
            sync(device)
            t0 = time.perf_counter()
            step(state)
            sync(device)
            plain.append(time.perf_counter() - t0)
        rep.check("saves committed on 2 ranks", None if all(i.world_size == 2 for i in infos.values())
                  else f"world sizes {[i.world_size for i in infos.values()]}")
        rep.check("listed", None if [i.tag for i in ck.list()] == list(infos) else f"list() gives {ck.list()}")
        del state
        for tag, clone, _p, _i in saves:
            fresh = make(1)
            handle = ck.restore(fresh, tag)
            rep.check(f"restore {tag} bit-exact", differences(snapshot(fresh), clone))
            if handle.stats.get("resharded"):
                rep.check(f"restore {tag} in place", f"resharded {handle.stats['resharded'][:3]}")
            del fresh
        mid = saves[(len(saves) - 1) // 2][0]  # (the middle save; with two, the first)
        fresh = make(2)
        ck.restore(fresh, mid)
        while fresh["step"] < args["steps"]:
            step(fresh)
        rep.check(f"resume from {mid} = uninterrupted run", differences(snapshot(fresh), final))
        del fresh
    record_costs(rep, infos, save_call_s, steps_s, done_at, [i for _t, _c, _p, i in saves], plain)


def record_costs(rep: Report, infos: dict[str, Any], save_call_s: dict[str, float], steps_s: list[float],
                 done_at: dict[str, int], save_steps: list[int], plain: list[float]) -> None:
    """Variant e: per save, the time inside save() spent coordinating (the id's derivation, no
    message), save()'s stall, the writer's coordination (describe + wait for rank 0's
    decision), and the step's extra time: the step with save() minus the median plain step
    (``plain``: steps run once every save was done), and the extra of the later steps while
    the save was in flight (``done_at``: the step it was seen done after; a step with another
    save() call is left out)."""
    median = statistics.median(plain)
    rep.number("plain_step_ms", round(median * 1e3, 2))
    rep.number("steps_ms", [round(s * 1e3, 2) for s in steps_s])
    rows = []
    for (tag, info), index in zip(infos.items(), save_steps):
        extra_after = sum(steps_s[i] - median for i in range(index + 1, done_at.get(tag, len(steps_s) - 1) + 1)
                          if i not in save_steps)
        rows.append({"tag": tag, "coordinate_ms": round(info.stats["save_phases_s"]["coordinate"] * 1e3, 3),
                     "stall_ms": round(info.stats["stall_s"] * 1e3, 2),
                     "save_call_ms": round(save_call_s[tag] * 1e3, 2),
                     "step_extra_ms": round((steps_s[index] - median) * 1e3, 2),
                     "in_flight_extra_ms": round(extra_after * 1e3, 2),
                     "writer_coordination_ms": round(info.stats["coordination_s"] * 1e3, 2),
                     "duration_s": round(info.stats["duration_s"], 3),
                     "bytes_written": info.stats.get("bytes_written", 0)})
    rep.number("saves", rows)
    later = rows[1:] or rows  # (the first save joins the group and grows the staging arena)
    for key in ("coordinate_ms", "stall_ms", "step_extra_ms", "in_flight_extra_ms", "writer_coordination_ms"):
        rep.number(f"median_{key}", round(statistics.median(r[key] for r in later), 3))


# -- variants ---------------------------------------------------------------------------------
def ddp(rep: Report, args: dict[str, Any], device: torch.device, root: Path, out: Path) -> None:
    """a: DDP over gloo, fused AdamW (cuda), saves every K steps during training."""
    def make(seed: int) -> dict[str, Any]:
        net = build_net(args, device, seed)
        model = nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
        return {"model": model, "optim": adamw(model.parameters(), device), "rng": gpusnap.RNGState(), "step": 0}

    train_and_check(rep, make, lambda s: model_step(s, args, device), root, args, device, config(args))


def fsdp2(rep: Report, args: dict[str, Any], device: torch.device, root: Path, out: Path) -> None:
    """b: FSDP2 (fully_shard per block and at the top) over the 2 ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))

    def make(seed: int) -> dict[str, Any]:
        net = build_net(args, device, seed)
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return {"model": net, "optim": adamw(net.parameters(), device), "rng": gpusnap.RNGState(), "step": 0}

    train_and_check(rep, make, lambda s: model_step(s, args, device), root, args, device, config(args),
                    last_save=lambda s, tag, clone: write_shards(s, tag, clone, out, "fsdp2"))


def dtensor(rep: Report, args: dict[str, Any], device: torch.device, root: Path, out: Path) -> None:
    """b, fallback: the model's parameters as DTensors (weights Shard(0), the rest Replicate)
    made with ``distribute_tensor``, AdamW on gradients drawn per step (no forward: a sharded
    matmul would need collectives gloo may lack on CUDA tensors)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    fell_back: list[str] = []

    def distribute(full: torch.Tensor, placements: list[Any]) -> Any:
        if not fell_back:
            try:
                return distribute_tensor(full, mesh, placements)
            except Exception as exc:  # (gloo without scatter for CUDA tensors): cut locally instead
                fell_back.append(f"distribute_tensor failed ({str(exc).splitlines()[0][:160]}): DTensor.from_local used")
                rep.note(fell_back[0])
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
        piece = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))].contiguous()
        return DTensor.from_local(piece, mesh, placements, run_check=False)

    def make(seed: int) -> dict[str, Any]:
        net = build_net(args, device, seed)
        for module in net.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                placements = [Shard(0)] if p.dim() == 2 else [Replicate()]
                setattr(module, name, nn.Parameter(distribute(p.detach(), placements)))
        return {"model": net, "optim": adamw(net.parameters(), device, fused=False), "rng": gpusnap.RNGState(),
                "step": 0}

    def step(state: dict[str, Any]) -> None:
        for p in state["model"].parameters():
            noise = torch.randn(p.to_local().shape, device=device)
            if p.placements[0] == Replicate():  # the replicas must stay equal: one draw for both ranks
                gen = torch.Generator(device=device).manual_seed(state["step"])
                noise = torch.randn(p.to_local().shape, device=device, generator=gen)
            p.grad = DTensor.from_local(noise, mesh, p.placements, run_check=False)
        state["optim"].step()
        state["optim"].zero_grad(set_to_none=True)
        state["step"] += 1

    train_and_check(rep, make, step, root, args, device, config(args),
                    last_save=lambda s, tag, clone: write_shards(s, tag, clone, out, "dtensor"))


def write_shards(state: dict[str, Any], tag: str, clone: dict[str, Any], out: Path, variant: str) -> None:
    """This rank's local tensors of save ``tag`` (``clone``, moved to the host) with their place
    in the global tensor (the live DTensors' layout, unchanged since), and its plain values:
    what ``reshard`` assembles the full state from."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    pieces: dict[str, Any] = {}
    for key, value in snapshot_live(state).items():
        if hasattr(value, "to_local"):
            _shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
            pieces[key] = (clone[key].cpu(), tuple(offset), tuple(value.shape))
        else:
            pieces[key] = (clone[key].cpu(), (0,) * value.dim(), tuple(value.shape))
    torch.save({"pieces": pieces, "step": clone["step"]}, out / f"{variant}-shards-{tag}-{dist.get_rank()}.pt")


def snapshot_live(state: dict[str, Any]) -> dict[str, Any]:
    """The model's and optimizer's tensors as they are (DTensors kept), keyed as :func:`snapshot`."""
    out = {f"model.{k}": v for k, v in state["model"].state_dict().items()}
    for i, moments in state["optim"].state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v for k, v in moments.items() if torch.is_tensor(v)})
    return out


def reshard(rep: Report, args: dict[str, Any], device: torch.device, root: Path, out: Path) -> None:
    """c: one process, no process group: the 2-rank checkpoint restored into the unsharded
    model on the device, and ``gpusnap.load`` assembling full tensors, both compared with the
    full tensors cut from the ranks' local shards at the save."""
    source, tag, root = args["source"], args["tag"], Path(args["root_of"])
    full = assemble([torch.load(out / f"{source}-shards-{tag}-{r}.pt") for r in range(2)])
    net = build_net(args, device, 5)
    target = {"model": net, "optim": adamw(net.parameters(), device, fused=source == "fsdp2"),
              "rng": gpusnap.RNGState(), "step": 0}
    with gpusnap.Checkpointer(root, config=config(args)) as ck:
        info = ck.latest()
        rep.number("saved_world_size", info.world_size if info else None)
        t0 = time.perf_counter()
        handle = ck.restore(target, tag)
        sync(device)
        rep.number("restore_s", round(time.perf_counter() - t0, 3))
    rep.number("resharded_keys", len(handle.stats.get("resharded", [])))
    got = {k: v for k, v in snapshot(target).items() if k in full}
    rep.check("restore 2 -> 1 into the unsharded model", differences(got, full))
    rep.check("on the device", None if all(t.device == device for k, t in got.items() if k.startswith("model."))
              else "a parameter is elsewhere")
    t0 = time.perf_counter()
    loaded = gpusnap.load(root, tag, device=device)
    rep.number("load_s", round(time.perf_counter() - t0, 3))
    flat = {f"model.{k}": v for k, v in loaded["model"].items()}
    for i, moments in loaded["optim"]["state"].items():
        flat.update({f"optim.{i}.{k}": v for k, v in moments.items() if torch.is_tensor(v)})
    rep.check("gpusnap.load assembles full tensors", differences({k: v for k, v in flat.items() if k in full}, full))
    missing = sorted(set(full) - set(flat))
    rep.check("gpusnap.load has every tensor", None if not missing else f"missing {missing[:5]}")


def assemble(ranks: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Full tensors from each rank's local pieces and offsets."""
    full: dict[str, torch.Tensor] = {}
    for doc in ranks:
        for key, (piece, offset, shape) in doc["pieces"].items():
            whole = full.setdefault(key, torch.empty(shape, dtype=piece.dtype))
            whole[tuple(slice(o, o + n) for o, n in zip(offset, piece.shape))] = piece
    return full


def kill(rep: Report, args: dict[str, Any], device: torch.device, root: Path, out: Path) -> None:
    """d: a first save commits; during the second, rank ``victim`` SIGKILLs itself at one of its
    first chunk writes. The survivor's wait() must raise within Config.collective_timeout_s,
    nothing more be committed, and the first save restore (here, in one process)."""
    from gpusnap.storage import txn

    rank, victim = dist.get_rank(), args["victim"]
    cfg = config(args, collective_timeout_s=args["kill_timeout_s"])

    def make(seed: int) -> dict[str, Any]:
        net = build_net(args, device, seed)
        model = nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
        return {"model": model, "optim": adamw(model.parameters(), device), "rng": gpusnap.RNGState(), "step": 0}

    state = make(0)
    seed_ranks(rank)
    model_step(state, args, device)
    with gpusnap.Checkpointer(root, config=cfg) as ck:
        first = snapshot(state)
        ck.save(state, tag="first").wait()
        model_step(state, args, device)  # every parameter and moment changes: the next save writes chunks
        dist.barrier()
        if rank == victim:
            left = [args["chunk"]]
            real = txn.WriteTxn.put_chunk

            def put_chunk(self: Any, digest: str, data: Any) -> bool:
                left[0] -= 1
                if left[0] < 0:
                    (out / f"kill-moment-{victim}").write_text(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(self, digest, data)

            txn.WriteTxn.put_chunk = put_chunk  # type: ignore[method-assign]
        pending = ck.save(state, tag="second")
        try:
            pending.wait()
            rep.check("the survivor's wait() raises", "it returned: the save committed")
        except gpusnap.CheckpointError as exc:
            raised = time.time()
            rep.note(f"wait() raised: {str(exc).splitlines()[0][:200]}")
            moment = out / f"kill-moment-{victim}"
            killed = float(moment.read_text()) if moment.exists() else float("nan")
            rep.number("raised_after_kill_s", round(raised - killed, 3))
            rep.check("raised within collective_timeout_s",
                      None if raised - killed < args["kill_timeout_s"] else f"{raised - killed:.1f} s")
        rep.check("nothing more committed", None if [i.tag for i in ck.list()] == ["first"]
                  else f"list() gives {[i.tag for i in ck.list()]}")
        try:
            ck.close()
        except gpusnap.CheckpointError as exc:  # (its failure, raised once more if unobserved)
            rep.note(f"close(): {str(exc).splitlines()[0][:120]}")
    # the survivor alone (its peer is gone: no collective): the first save, rank 0's part
    loaded = gpusnap.load(root, device=device)
    flat = {f"model.{k}": v for k, v in loaded["model"].items()}
    rep.check("gpusnap.load gives the first save",
              differences(flat, {k: v for k, v in first.items() if k.startswith("model.")}))
    holder = nn.ModuleDict({"module": build_net(args, device, 9)})  # (DDP's keys: "module.<name>")
    target = {"model": holder, "optim": adamw(holder.parameters(), device), "rng": gpusnap.RNGState(), "step": 0}
    with gpusnap.Checkpointer(root, process_group=False, config=cfg) as alone:
        alone.restore(target)
    want = {k: v for k, v in first.items() if not k.startswith("rng.")}  # (rank 0's generators, not mine)
    rep.check("the first save restores", differences({k: v for k, v in snapshot(target).items()
                                                      if not k.startswith("rng.")}, want))


VARIANTS: dict[str, Callable[[Report, dict[str, Any], torch.device, Path, Path], None]] = {
    "ddp": ddp, "fsdp2": fsdp2, "dtensor": dtensor, "reshard": reshard, "kill": kill}


def config(args: dict[str, Any], **kw: Any) -> gpusnap.Config:
    return gpusnap.Config(**{"collective_timeout_s": args["collective_timeout_s"], "fsync": args["fsync"], **kw})


def main() -> None:
    variant, rank_s, world_s, out_s, root_s, args_s = sys.argv[1:7]
    rank, world, out, root, args = int(rank_s), int(world_s), Path(out_s), Path(root_s), json.loads(args_s)
    faulthandler.dump_traceback_later(args["hang_s"], exit=False)  # (a hang's stacks, in the log)
    gpus = int(args.get("gpus", 1))
    device = torch.device(f"cuda:{rank % gpus}" if args["device"] == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.use_deterministic_algorithms(True, warn_only=True)  # (the resume check compares bits)
        torch.utils.deterministic.fill_uninitialized_memory = False  # (it would fill every torch.empty)
    rep = Report(variant, rank)
    try:
        if world > 1:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                                  timeout=timedelta(seconds=args["hang_s"]))
            # a rank whose collective failed alone leaves its peer in one: bounded by this timeout
            backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" and gpus > 1 else "gloo"
            dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=min(args["hang_s"], args["collective_timeout_s"])))
        VARIANTS[variant](rep, args, device, root, out)
    except BaseException as exc:
        traceback.print_exc()
        rep.doc["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"[:300]
        rep.write(out)
        sys.stdout.flush()
        os._exit(1)  # (a peer may be stuck: leave without the process group's teardown)
    rep.write(out)
    sys.stdout.flush()
    if variant == "kill":
        os._exit(0)  # the process group lost a rank
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
