"""``gpusnap demo``: train a small model, checkpoint it while it trains, restore, compare.

It proves three things a newcomer cares about, on CPU or CUDA:
1. ``save()`` returns quickly and training goes on while the checkpoint is written;
2. a fresh model restored from a checkpoint equals, bit for bit, the state at that save;
3. training resumed from the checkpoint reproduces the uninterrupted run bit for bit
   (dropout and data RNG included, through ``gpusnap.RNGState``).
"""

from __future__ import annotations

import shlex
import tempfile
import time
from typing import Any

import torch
from torch import nn

import gpusnap
from gpusnap.cli.render import human_bytes

__all__ = ["run_demo"]


def _build(device: torch.device, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8)
    ).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=20, gamma=0.5)
    return {"model": model, "optim": optim, "sched": sched, "rng": gpusnap.RNGState(), "step": 0}


def _train_step(state: dict[str, Any], device: torch.device) -> None:
    x = torch.randn(128, 64, device=device)
    y = torch.randn(128, 8, device=device)
    loss = nn.functional.mse_loss(state["model"](x), y)
    state["optim"].zero_grad(set_to_none=True)
    loss.backward()
    state["optim"].step()
    state["sched"].step()
    state["step"] += 1


def _tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in state["model"].state_dict().values()]
    for per_param in state["optim"].state.values():
        out += [v.detach().clone() for v in per_param.values() if isinstance(v, torch.Tensor)]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def run_demo(root: str | None, *, steps: int = 60, every: int = 10, device: str | None = None) -> bool:
    """Runs the demo and prints a table; returns True when every check passed."""
    if steps < 2 or every < 1 or every >= steps:
        raise ValueError("demo needs steps >= 2 and 1 <= every < steps")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # kept afterwards (a temporary directory unless given): the newcomer looks at it next
    root = root or tempfile.mkdtemp(prefix="gpusnap-demo-")
    print(f"gpusnap demo on {dev}: {steps} training steps, a checkpoint every {every} steps, root {root}")

    # Reference: the uninterrupted run.
    ref = _build(dev, seed=0)
    for _ in range(steps):
        _train_step(ref, dev)
    reference_final = _tensors(ref)

    # The same run, checkpointed while it trains.
    run = _build(dev, seed=0)
    at_save: dict[str, list[torch.Tensor]] = {}
    pendings = []
    with gpusnap.Checkpointer(root, keep_last=3) as ckpt:
        while run["step"] < steps:
            _train_step(run, dev)
            if run["step"] % every == 0 and run["step"] < steps:
                tag = f"step-{run['step']}"
                pendings.append((run["step"], ckpt.save(run, tag=tag)))
                at_save[tag] = _tensors(run)
        infos = [(step, p.wait()) for step, p in pendings]  # committed (in host memory, by default)
        ckpt.wait()  # and durable in the root
        _mid_step, mid = infos[len(infos) // 2] if len(infos) > 2 else infos[-1]
        kept = {i.id for i in ckpt.list()}

        # Restore into a fresh, differently initialised model and compare.
        fresh = _build(dev, seed=123)
        _train_step(fresh, dev)  # gives it optimizer state of its own, to be overwritten
        t0 = time.perf_counter()
        handle = ckpt.restore(fresh, mid.id if mid.id in kept else None)
        restore_s = time.perf_counter() - t0
        restored_tag = next(i.tag for s, i in infos if i.id == handle.checkpoint_id)
        equal_at_save = _same(_tensors(fresh), at_save[restored_tag])  # type: ignore[index]
        while fresh["step"] < steps:
            _train_step(fresh, dev)
        resumed_equal = _same(_tensors(fresh), reference_final)

    print()
    print(f"{'checkpoint':<28} {'step':>5} {'size':>10} {'stall':>10} {'committed':>10}")
    for step, info in infos:
        mark = " (kept)" if info.id in kept else ""
        print(
            f"{info.id + mark:<28} {step:>5} {human_bytes(info.nbytes):>10} "
            f"{info.stats['stall_s'] * 1e3:>7.1f} ms {info.stats['duration_s']:>8.3f} s"
        )
    print()
    print(f"restore of {restored_tag} into a fresh model: {restore_s * 1e3:.1f} ms")
    print(f"restored state == state at that save (bitwise): {'yes' if equal_at_save else 'NO'}")
    print(f"resumed run == uninterrupted run (bitwise):     {'yes' if resumed_equal else 'NO'}")
    print(f"checkpoints kept with keep_last=3:              {len(kept)}")
    ok = equal_at_save and resumed_equal and len(kept) == min(3, len(infos))
    print("demo: OK" if ok else "demo: FAILED")
    print(f"the checkpoints are kept; look at them: gpusnap ls {shlex.quote(root)}")
    return ok
