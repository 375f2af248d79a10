"""One rank of a multi-rank test (run by dist_support.run_ranks):

    python dist_workers.py SCENARIO RANK WORLD STORE_FILE DIR ARGS_JSON

Each scenario asserts what it checks and writes ``DIR/SCENARIO-RANK.json`` (its result);
phases are separated by ``dist.barrier()`` on the main thread (test code, not gpusnap's).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gpusnap


def cfg(**kw: Any) -> gpusnap.Config:
    return gpusnap.Config(**{"collective_timeout_s": 60, "io_threads": 2, **kw})


def raises(fn: Any, *types: type[BaseException]) -> str:
    """The message of the error ``fn()`` raises (one of ``types``); AssertionError if none."""
    try:
        fn()
    except types as exc:
        return str(exc)
    raise AssertionError(f"{fn} raised nothing")


def ddp_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    optim = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    return {"model": ddp, "optim": optim, "rng": gpusnap.RNGState(), "step": 0}


def ddp_train(state: dict[str, Any], steps: int) -> None:
    model, optim = state["model"], state["optim"]
    for _ in range(steps):
        gen = torch.Generator().manual_seed(1000 * dist.get_rank() + state["step"])
        x = torch.randn(6, 8, generator=gen)
        optim.zero_grad()
        model(x).square().mean().backward()
        optim.step()
        state["step"] += 1


def params(state: dict[str, Any]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state["model"].parameters()]


# -- scenarios ------------------------------------------------------------------------------
def protocol(rank: int, world: int, where: Path, args: dict[str, Any]) -> dict[str, Any]:
    """Commits, disagreements (tags, keys, shapes, a rank that does not save), collective
    restore (and a mismatch on one rank), the one-writer rule, per-process mode alongside."""
    out: dict[str, Any] = {}
    state = ddp_state(0)
    root = where / "protocol"
    with gpusnap.Checkpointer(root, keep_last=3, config=cfg()) as ck:
        for _ in range(2):
            ddp_train(state, 1)
            info = ck.save(state, tag=f"step{state['step']}").wait()
            assert info.world_size == world, info
        out["committed"] = [(i.id, i.tag, i.world_size) for i in ck.list()]
        assert [t for _, t, _ in out["committed"]] == ["step1", "step2"]

        out["tags"] = raises(lambda: ck.save(state, tag=f"t{rank}").wait(), gpusnap.CheckpointError)
        assert "different tags" in out["tags"], out["tags"]
        extra = {**state, **({"extra": 1} if rank == 1 else {})}
        out["keys"] = raises(lambda: ck.save(extra).wait(), gpusnap.CheckpointError)
        assert "extra" in out["keys"] and "differ" in out["keys"], out["keys"]
        shaped = {**state, "buf": torch.zeros(3 + rank)}
        out["shapes"] = raises(lambda: ck.save(shaped).wait(), gpusnap.CheckpointError)
        assert "buf" in out["shapes"] and "[3]" in out["shapes"] and "[4]" in out["shapes"], out["shapes"]
        assert [i.id for i in ck.list()] == [i for i, _, _ in out["committed"]]  # nothing committed
        ck.save(state).wait()  # ranks that disagreed are still in step

        before = params(state)
        saved_step = state["step"]
        ddp_train(state, 2)
        ck.restore(state, "step2")
        assert state["step"] == 2
        ck.restore(state)  # the latest
        assert state["step"] == saved_step and all(torch.equal(a, b) for a, b in zip(before, params(state)))
        bad = {**state, "model": nn.Linear(3, 3) if rank == 1 else state["model"]}
        ddp_train(state, 1)
        moved = params(state)
        out["mismatch"] = raises(lambda: ck.restore(bad), gpusnap.CheckpointError)
        assert all(torch.equal(a, b) for a, b in zip(moved, params(state)))  # nothing written on any rank

        out["second_writer"] = raises(lambda: gpusnap.Checkpointer(root, config=cfg()).save(state),
                                      gpusnap.StorageError)
    dist.barrier()

    # a rank that does not save: the others' save fails within the timeout, then no save is trusted
    with gpusnap.Checkpointer(where / "lonely", config=cfg(collective_timeout_s=2)) as ck:
        if rank == 0:
            out["lonely"] = raises(lambda: ck.save(state).wait(), gpusnap.CheckpointError)
            assert "did not report its part" in out["lonely"], out["lonely"]
        dist.barrier()
        if rank != 0:  # a save the others already gave up on: refused as they were
            out["lonely"] = raises(lambda: ck.save(state).wait(), gpusnap.CheckpointError)
        out["broken"] = raises(lambda: ck.save(state), gpusnap.CheckpointError)
        assert "cannot save any more" in out["broken"], out["broken"]
        assert ck.list() == []
        try:
            ck.close()
        except gpusnap.CheckpointError:
            pass  # (the failures above, raised again: already seen)
    dist.barrier()

    with gpusnap.Checkpointer(where / f"own-{rank}", process_group=False) as ck:  # per process, as before
        assert ck.save(state).wait().world_size == 1
    return out


def resume(rank: int, world: int, where: Path, args: dict[str, Any]) -> dict[str, Any]:
    """``args["phase"]`` "first": train 6 steps, a save at step 3 while training goes on,
    keep the final parameters; "again" (fresh processes, another init): restore step 3,
    train to 6, and match the first run bit for bit."""
    state = ddp_state(0 if args["phase"] == "first" else 99)
    ddp_train(state, 1)  # (DDP's first step differs: bucket rebuild; both runs take it)
    root = where / "resume"
    final = where / f"resume-final-{rank}.pt"
    with gpusnap.Checkpointer(root, config=cfg()) as ck:
        if args["phase"] == "first":
            ddp_train(state, 2)
            pending = ck.save(state, tag="step3")
            ddp_train(state, 3)  # concurrent with the save
            pending.wait()
            torch.save(params(state), final)
            return {"step": state["step"]}
        ck.restore(state, "step3")
        assert state["step"] == 3
        ddp_train(state, 3)
        expected = torch.load(final)
        assert all(torch.equal(a, b) for a, b in zip(expected, params(state))), "resumed run differs"
        return {"step": state["step"]}


def kill(rank: int, world: int, where: Path, args: dict[str, Any]) -> dict[str, Any]:
    """A first save commits; during the second, rank ``args["victim"]`` is SIGKILLed (during
    its chunk writes, at a random chunk, or once its part is durable); the survivors' wait
    raises, nothing more is committed. Rank 0 killed once it committed: the save stands."""
    from gpusnap.distributed import protocol
    from gpusnap.storage import txn

    victim, moment = args["victim"], args["moment"]
    state = {"w": torch.arange(64 * 1024, dtype=torch.float32) + rank, "step": 1}
    root = where / "kill"
    with gpusnap.Checkpointer(root, config=cfg(chunk_size=4096)) as ck:
        ck.save(state).wait()
        dist.barrier()
        if rank == victim:
            if moment == "write":
                left = [args["chunk"]]
                real = txn.WriteTxn.put_chunk

                def put_chunk(self: Any, digest: str, data: Any) -> bool:
                    left[0] -= 1
                    if left[0] < 0:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return real(self, digest, data)

                txn.WriteTxn.put_chunk = put_chunk  # type: ignore[method-assign]
            else:  # once its part is durable; "committed": rank 0 once the global manifest is too
                step = "publish" if moment == "committed" else "report"
                setattr(protocol.Rounds, step, lambda *a: os.kill(os.getpid(), signal.SIGKILL))
        state["w"].add_(1)
        state["step"] = 2
        if moment == "committed":  # the global manifest is there: the survivors' save succeeded
            assert ck.save(state).wait().world_size == world and len(ck.list()) == 2
            error = raises(lambda: ck.save(state), gpusnap.CheckpointError)  # but they are unpaired now
            assert "cannot save any more" in error, error
        else:
            error = raises(lambda: ck.save(state).wait(), gpusnap.CheckpointError)
            assert "ended" in error, error  # noticed as gone, not waited out
            assert len(ck.list()) == 1
        write({"error": error}, where, "kill", rank)
        os._exit(0)  # the process group lost a rank: leave without its teardown


def fsdp_state(world: int, seed: int) -> dict[str, Any]:
    """FSDP2 over ``world`` ranks (uneven shards: 7 and 3 rows over 4 ranks), its AdamW, a
    replicated DTensor (stored once) and a Partial one (never resharded)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate

    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    rep = DTensor.from_local(torch.arange(6.0) * (seed + 1), mesh, [Replicate()], run_check=False)
    partial = DTensor.from_local(torch.full((2,), float(dist.get_rank() + seed)), mesh, [Partial()], run_check=False)
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2), "rep": rep,
            "partial": partial, "step": 0}


def fsdp_train(state: dict[str, Any], steps: int) -> None:
    for _ in range(steps):
        gen = torch.Generator().manual_seed(1000 * dist.get_rank() + state["step"])
        state["optim"].zero_grad()
        state["model"](torch.randn(4, 5, generator=gen)).square().mean().backward()
        state["optim"].step()
        state["step"] += 1


def full(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer moment whole (DTensor.full_tensor: a collective, test side)."""
    out = {f"model.{k}": v.full_tensor() for k, v in state["model"].state_dict().items()}
    for i, moments in state["optim"].state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in moments.items()})
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def fsdp_save(rank: int, world: int, where: Path, args: dict[str, Any]) -> dict[str, Any]:
    """FSDP2 on 4 ranks: saves during training, restore in place (same layout: bit-exact, the
    same storages), a tag one rank disagrees on."""
    state = fsdp_state(world, 0)
    with gpusnap.Checkpointer(where / "fsdp4", config=cfg()) as ck:
        fsdp_train(state, 1)
        pending = ck.save(state, tag="step1")
        fsdp_train(state, 1)  # while the save runs
        pending.wait()
        fsdp_train(state, 1)
        info = ck.save(state, tag="step3", blocking=True).wait()
        assert info.world_size == world
        saved = full(state)
        if rank == 0:
            torch.save(saved, where / "fsdp4-full.pt")
        locals_ = [p._local_tensor for p in state["model"].parameters()]
        ptrs = [t.data_ptr() for t in locals_]
        fsdp_train(state, 2)
        state["rep"].to_local().add_(1)  # (rank 0 stored it for every rank)
        state["partial"].to_local().add_(1)
        handle = ck.restore(state, "step3")
        assert handle.stats["resharded"] == [] and state["step"] == 3
        assert [p._local_tensor.data_ptr() for p in state["model"].parameters()] == ptrs
        assert same(full(state), saved)
        assert torch.equal(state["rep"].to_local(), torch.arange(6.0))
        assert torch.equal(state["partial"].to_local(), torch.full((2,), float(rank)))
        error = raises(lambda: ck.save(state, tag="last" if rank != 3 else "other").wait(), gpusnap.CheckpointError)
        assert "different tags" in error, error
    return {"id": info.id}


def fsdp_reshard(rank: int, world: int, where: Path, args: dict[str, Any]) -> dict[str, Any]:
    """2 ranks: the 4-rank checkpoint into FSDP2 over 2 (a fresh model and optimizer: resharded,
    Partial refused), then a per-process checkpoint of a plain model into FSDP2 over 2 (1 -> 2);
    train, save (for 2 -> 1)."""
    out: dict[str, Any] = {}
    state = fsdp_state(world, 7)
    with gpusnap.Checkpointer(where / "fsdp4", config=cfg()) as ck:
        out["partial"] = raises(lambda: ck.restore(state, "step3"), gpusnap.RestoreMismatchError)
        assert "partial" in out["partial"] and "cannot reshard" in out["partial"], out["partial"]
        del state["partial"]
        handle = ck.restore(state, "step3", strict=False)
        assert handle.stats["unexpected"] == ["partial"] and "model/0.weight" in handle.stats["resharded"]
    assert same(full(state), torch.load(where / "fsdp4-full.pt")) and state["step"] == 3
    assert torch.equal(state["rep"].to_local(), torch.arange(6.0))

    plain = fsdp_state(world, 11)
    del plain["rep"], plain["partial"]
    with gpusnap.Checkpointer(where / "plain", config=cfg()) as ck:  # saved by one process, no DTensors
        ck.restore(plain)
    assert same(full(plain), torch.load(where / "plain-full.pt"))

    fsdp_train(state, 1)
    with gpusnap.Checkpointer(where / "fsdp2", config=cfg()) as ck:
        ck.save(state).wait()
    saved = full(state)
    if rank == 0:
        torch.save(saved, where / "fsdp2-full.pt")
    return out


SCENARIOS = {"protocol": protocol, "resume": resume, "kill": kill, "fsdp_save": fsdp_save,
             "fsdp_reshard": fsdp_reshard}


def write(result: dict[str, Any], where: Path, scenario: str, rank: int) -> None:
    (where / f"{scenario}-{rank}.json").write_text(json.dumps(result))


def main() -> None:
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ.get("GPUSNAP_DIST_HANG_S", "200")), exit=True)
    scenario, rank, world, store, where, args = sys.argv[1:7]
    r, w = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=r, world_size=w)
    result = SCENARIOS[scenario](r, w, Path(where), json.loads(args))
    write(result, Path(where), scenario, r)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
