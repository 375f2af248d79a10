"""The writer thread's Python per warm fast-tier save, on the CPU (issue 22): a diagnosis.

On the H200 a warm fast-tier save costs training most in the step during which it commits:
the writer thread's Python (finishing the capture, the manifest of every chunk, retention's
used-range map) holds the GIL against the training thread. This reproduces that path on the
CPU with a transformer-shaped state (a model and its AdamW state, hundreds of tensors of
varied sizes) and a small ``chunk_size`` so that it has the chunk count of an 11.4 GB state
at 4 MiB chunks, and reports, per warm save:

- the writer thread's CPU time in ``Checkpointer._run_job`` (finish, manifest, commit,
  retention: everything it does for one save) and its wall time from ``save()`` returning to
  the commit;
- the copier thread's CPU time in the fast tier's chunk bookkeeping (``_locate_many``);
- with ``--profile``, a cProfile of the writer thread's ``_run_job`` over the warm saves,
  its top functions by own time and by cumulative time.

CPU numbers are for comparing code paths on one machine, not performance claims:

  PYTHONPATH=src python3 experiments/commit_profile.py --saves 8 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shutil
import statistics
import tempfile
import threading
import time

import torch
from torch import nn

import gpusnap
from gpusnap.capture import concurrent as concurrent_mod
from gpusnap.checkpointer import Checkpointer

KiB = 1 << 10


class Block(nn.Module):
    """A Llama-style decoder block's parameters (the forward is a cheap stand-in)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden // 4, bias=False)
        self.v = nn.Linear(hidden, hidden // 4, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.gate = nn.Linear(hidden, inter, bias=False)
        self.up = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)
        self.norm1 = nn.Parameter(torch.ones(hidden))
        self.norm2 = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, self.norm1)
        h = self.o(self.q(h) + self.k(h).repeat(1, 4) + self.v(h).repeat(1, 4))
        x = x + h
        h = rms_norm(x, self.norm2)
        return x + self.down(torch.relu(self.gate(h)) * self.up(h))


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * weight


class Model(nn.Module):
    def __init__(self, vocab: int, hidden: int, inter: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, inter) for _ in range(layers))
        self.norm = nn.Parameter(torch.ones(hidden))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(rms_norm(x, self.norm))


def make_state(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model = Model(args.vocab, args.hidden, args.inter, args.layers)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = {"model": model, "optim": optim, "step": 0}
    train(state)
    return state


def train(state: dict) -> None:
    model, optim = state["model"], state["optim"]
    ids = torch.randint(0, model.embed.num_embeddings, (64,))
    model(ids).float().square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=False)
    state["step"] += 1


class Meter:
    """CPU time of the writer's ``_run_job`` and of the copier's ``_locate_many``, per save;
    optionally a cProfile of ``_run_job``."""

    def __init__(self, profile: bool) -> None:
        self.profiler = cProfile.Profile() if profile else None
        self.run_job_cpu: list[float] = []
        self.locate_cpu = 0.0
        self.committed_at: list[float] = []
        self.profiling = False
        self._lock = threading.Lock()
        run_job = Checkpointer._run_job
        locate = concurrent_mod.ConcurrentSave._locate_many
        meter = self

        def timed_run_job(ck, repo, job):  # the writer thread
            cpu = time.thread_time()
            prof = meter.profiler if meter.profiling else None
            if prof is not None:
                prof.enable()
            try:
                return run_job(ck, repo, job)
            finally:
                if prof is not None:
                    prof.disable()
                meter.run_job_cpu.append(time.thread_time() - cpu)

        def timed_locate(self_, pieces):  # the copier thread
            cpu = time.thread_time()
            try:
                return locate(self_, pieces)
            finally:
                with meter._lock:
                    meter.locate_cpu += time.thread_time() - cpu

        Checkpointer._run_job = timed_run_job  # type: ignore[method-assign]
        concurrent_mod.ConcurrentSave._locate_many = timed_locate  # type: ignore[method-assign]


def chunk_count(state: dict, chunk: int) -> tuple[int, int, int]:
    """(tensors, bytes, chunks) of the state's tensors (each storage once)."""
    seen, nbytes, chunks = set(), 0, 0
    tensors = [*state["model"].state_dict().values()]
    for s in state["optim"].state.values():
        tensors.extend(v for v in s.values() if isinstance(v, torch.Tensor))
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        n = t.untyped_storage().nbytes()
        nbytes += n
        chunks += -(-n // chunk)
    return len(seen), nbytes, chunks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--saves", type=int, default=8, help="warm saves measured (after two warm-up saves)")
    p.add_argument("--chunk-kib", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--frozen", action="store_true", help="no training step between saves (chunks reused)")
    p.add_argument("--profile", action="store_true", help="cProfile the writer's _run_job over the warm saves")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()

    state = make_state(args)
    tensors, nbytes, chunks = chunk_count(state, args.chunk_kib * KiB)
    print(f"state: {tensors} storages, {nbytes / 1e6:.1f} MB, {chunks} chunks of {args.chunk_kib} KiB")
    meter = Meter(args.profile)
    tmp = tempfile.mkdtemp(prefix="gpusnap-commit-profile-", dir="/tmp")
    cfg = gpusnap.Config(chunk_size=args.chunk_kib * KiB, copy_piece_bytes=32 << 20, fast_slab_bytes=256 << 20,
                         cpu_snapshot_bytes=1 << 30,  # copied at save(), as the GPU path's device snapshot
                         fsync=False)
    rows = []
    try:
        with gpusnap.Checkpointer(f"{tmp}/root", fast_root=f"{tmp}/fast", fast_keep_last=2, config=cfg) as ck:
            ck.prepare(state, wait=True)
            for i in range(2 + args.saves):
                if not args.frozen:
                    train(state)
                warm = i >= 2
                meter.profiling = warm
                pending = ck.save(state)
                returned = time.perf_counter()
                info = pending.wait()
                wall = time.perf_counter() - returned
                if warm:
                    rows.append({"writer_cpu_ms": meter.run_job_cpu[-1] * 1e3, "wall_ms": wall * 1e3,
                                 "bytes_copied": info.stats["bytes_copied"]})
                elif i == 1:
                    meter.locate_cpu = 0.0  # (the warm saves' only)
            manifest = ck._fast_tier().resolve(None)
            n_chunks = sum(len(e.chunks) for e in manifest.storages)
            manifest_bytes = len(manifest.to_json())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cpu = [r["writer_cpu_ms"] for r in rows]
    wall = [r["wall_ms"] for r in rows]
    summary = {
        "chunks": n_chunks, "storages": tensors, "manifest_bytes": manifest_bytes,
        "writer_cpu_ms_median": statistics.median(cpu), "writer_cpu_ms_min": min(cpu),  # (min: the least disturbed)
        "writer_cpu_ms": [round(c, 1) for c in cpu],
        "save_to_commit_wall_ms_median": statistics.median(wall),
        "copier_locate_cpu_ms_per_save": meter.locate_cpu / max(1, len(rows)) * 1e3,
    }
    print(json.dumps(summary, indent=1))
    if meter.profiler is not None:
        for key in ("tottime", "cumulative", "ncalls"):
            out = io.StringIO()
            stats = pstats.Stats(meter.profiler, stream=out)
            stats.sort_stats(key).print_stats(args.top)
            print(f"--- writer thread's _run_job over {len(rows)} warm saves, by {key} ---")
            print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:12000])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
