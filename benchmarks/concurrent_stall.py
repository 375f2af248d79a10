"""Stall per checkpoint of a GPT-2 training loop: gpusnap concurrent vs blocking vs baselines.

Run on a GPU machine from the repository root:
    PYTHONPATH=src python3 benchmarks/concurrent_stall.py --model gpt2 --steps 30 --every 5
Prints one table; every checkpoint is restored into a fresh model and compared bitwise with a
clone taken at its consistent point. CPU runs are smoke tests, not performance figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import gpusnap


def build(name: str, device: torch.device, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    sizes = {"gpt2": (12, 768, 12), "gpt2-large": (36, 1280, 20), "tiny": (2, 64, 2)}
    n_layer, n_embd, n_head = sizes[name]
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=1024)
    model = GPT2LMHeadModel(cfg).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optim


def state_nbytes(model, optim) -> int:
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for s in optim.state.values():
        n += sum(v.numel() * v.element_size() for v in s.values() if torch.is_tensor(v))
    return n


def clone_state(model, optim) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in model.state_dict().values()]
    for s in optim.state.values():
        out += [v.detach().clone() for v in s.values() if torch.is_tensor(v)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--root", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, optim = build(args.model, dev)
    vocab = model.config.vocab_size
    data = torch.randint(0, vocab, (args.batch, args.seq), device=dev)

    def step() -> None:
        loss = model(data, labels=data).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    def timed(fn) -> float:
        torch.cuda.synchronize() if dev.type == "cuda" else None
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize() if dev.type == "cuda" else None
        return time.perf_counter() - t0

    for _ in range(3):
        step()
    nbytes = state_nbytes(model, optim)
    base = [timed(step) for _ in range(10)]
    median = statistics.median(base)
    root = args.root or tempfile.mkdtemp(prefix="gpusnap-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    results: dict[str, object] = {"model": args.model, "state_bytes": nbytes, "median_step_s": median,
                                  "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}

    # Baseline 1: stop-the-world copy into pinned host memory (allocated beforehand).
    tensors = list(model.state_dict().values()) + [v for s in optim.state.values() for v in s.values() if torch.is_tensor(v)]
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=dev.type == "cuda") for t in tensors]

    def stw_copy() -> None:
        for h, t in zip(pinned, tensors):
            h.copy_(t, non_blocking=True)
    stw = [timed(stw_copy) for _ in range(3)]
    results["stw_pinned_copy_s"] = min(stw)
    del pinned

    # Baseline 2: torch.save to tmpfs.
    path = os.path.join(root, "torch_save.pt")
    results["torch_save_s"] = timed(lambda: torch.save({"m": model.state_dict(), "o": optim.state_dict()}, path))
    os.remove(path)

    app = {"model": model, "optim": optim, "step": 0}
    cfg = gpusnap.Config.from_env()
    with gpusnap.Checkpointer(os.path.join(root, "ck"), config=cfg) as ck:
        # Baseline 3: gpusnap blocking save.
        results["gpusnap_blocking_s"] = timed(lambda: ck.save(app, blocking=True))
        # gpusnap concurrent: stall = step time with a save() before it, minus the median step.
        checks = []
        save_steps, plain_steps = [], []
        for i in range(args.steps):
            app["step"] = i
            if i % args.every == 0:
                def save_then_step() -> None:
                    pending = ck.save(app, tag=f"s{i}")
                    checks.append((pending, clone_state(model, optim)))
                    step()
                # the clone is part of the measured time: subtract it (measured separately below)
                save_steps.append(timed(save_then_step))
            else:
                plain_steps.append(timed(step))
        clone_s = statistics.median([timed(lambda: clone_state(model, optim)) for _ in range(3)])
        infos = [p.wait() for p, _ in checks]
        exact = True
        for (p, expected), info in zip(checks, infos):
            fresh_model, fresh_optim = build(args.model, dev, seed=1)
            fresh_model(data[:1], labels=data[:1]).loss.backward()
            fresh_optim.step()
            target = {"model": fresh_model, "optim": fresh_optim, "step": -1}
            ck.restore(target, info.id)
            got = clone_state(fresh_model, fresh_optim)
            exact &= len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
            del fresh_model, fresh_optim, target, got
        med_plain = statistics.median(plain_steps)
        stalls = [max(0.0, s - clone_s - med_plain) for s in save_steps]
        results.update(
            concurrent_stall_median_s=statistics.median(stalls),
            concurrent_stall_max_s=max(stalls),
            save_call_s=statistics.median(i.stats["stall_s"] for i in infos),
            durable_s=statistics.median(i.stats["duration_s"] for i in infos),
            window_s=statistics.median(i.stats["window_s"] for i in infos),
            bytes_cow=max(i.stats["bytes_cow"] for i in infos),
            waits=max(i.stats["waits"] for i in infos),
            median_plain_step_in_run_s=med_plain,
            all_checkpoints_bit_exact=exact,
        )
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n{'metric':<32}{'value':>14}")
    for k in ("state_bytes", "median_step_s", "stw_pinned_copy_s", "torch_save_s", "gpusnap_blocking_s",
              "save_call_s", "concurrent_stall_median_s", "concurrent_stall_max_s", "window_s", "durable_s",
              "bytes_cow", "waits", "all_checkpoints_bit_exact"):
        v = results[k]
        print(f"{k:<32}{v:>14.4f}" if isinstance(v, float) else f"{k:<32}{v!s:>14}")


if __name__ == "__main__":
    main()
