"""Restore speed: gpusnap's pipelined and lazy restore against torch.load and safetensors.

Run on a GPU machine from the repository root (about 2-4 minutes; checkpoints on /dev/shm):
    PYTHONPATH=src python3 benchmarks/restore_bench.py --out restore_bench.json
CPU smoke test (seconds; not a performance figure):
    PYTHONPATH=src python3 benchmarks/restore_bench.py --tiny --out /tmp/restore_bench.json

Per model, all in one process, files in page cache (tmpfs):
- pinned host-to-device bandwidth (1 GiB copy), the ceiling for any restore;
- gpusnap eager restore, in place: ``verify="stream"`` (every chunk checked: on the device
  when the manifest has device hashes), the same forced onto the host's BLAKE2b path, and
  ``"off"``; each with its per-stage figures (read, host verify and copy-stream GB/s, and
  which stage waited on which: ``stage_figures``);
- ``torch.load(map_location=device)`` + ``load_state_dict``; safetensors ``load_file`` to the
  device + ``load_state_dict`` (if installed);
- cold start to the first forward: a model built empty (``gpusnap.empty_model``) and restored
  lazily (``gpusnap.cold_start``), against the same build with an eager restore. The
  checkpoint is taken while a forward runs, so it records the order the weights are used in.
Every restored model's forward output is compared bitwise with the source model's.
Models: GPT-2 large (fp32) and a larger inference-only GPT-2 (bf16), from transformers'
GPT2Config with random weights; a small built-in GPT stands in where transformers is missing.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import gpusnap
from gpusnap.restore import restorer as restorer_mod


@dataclass(frozen=True)
class Spec:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    dtype: torch.dtype


FULL = [Spec("gpt2-large", 36, 1280, 20, torch.float32), Spec("gpt2-2.7b-bf16", 32, 2560, 20, torch.bfloat16)]
TINY = [Spec("tiny", 2, 64, 2, torch.float32), Spec("tiny-bf16", 4, 128, 4, torch.bfloat16)]


# -- models -------------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class _MiniGPT(nn.Module):
    """Fallback when transformers is missing: tied embeddings, a non-persistent causal mask."""

    def __init__(self, spec: Spec, vocab: int = 50257, ctx: int = 1024) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, spec.n_embd), nn.Embedding(ctx, spec.n_embd)
        self.blocks = nn.ModuleList(_Block(spec.n_embd, spec.n_head) for _ in range(spec.n_layer))
        self.ln_f = nn.LayerNorm(spec.n_embd)
        self.head = nn.Linear(spec.n_embd, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        x = self.wte(ids) + self.wpe(torch.arange(n, device=ids.device))
        mask = self.mask[:n, :n].to(x.dtype)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def builder(spec: Spec) -> tuple[Callable[[], nn.Module], str]:
    """A function that builds the model (random init), and which implementation it uses."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return (lambda: _MiniGPT(spec).to(spec.dtype)), "built-in MiniGPT (transformers not installed)"
    cfg = GPT2Config(n_layer=spec.n_layer, n_embd=spec.n_embd, n_head=spec.n_head, n_positions=1024)

    def build() -> nn.Module:
        model = GPT2LMHeadModel(cfg).to(spec.dtype)
        model.config.use_cache = False
        return model.eval()

    return build, "transformers GPT2LMHeadModel"


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def nbytes_of(model: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in model.state_dict().values():
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


# -- timing -------------------------------------------------------------------------------------
def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(dev: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return time.perf_counter() - t0, out


def best(dev: torch.device, fn: Callable[[], Any], repeat: int) -> float:
    return min(timed(dev, fn)[0] for _ in range(repeat))


def h2d_gbps(dev: torch.device, nbytes: int) -> float | None:
    if dev.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst.copy_(src, non_blocking=True)
    secs = best(dev, lambda: dst.copy_(src, non_blocking=True), 3)
    return nbytes / secs / 1e9


def pick_root(need: int, wanted: str | None) -> str:
    if wanted:
        return wanted
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > need:
        return tempfile.mkdtemp(prefix="gpusnap-restore-bench-", dir="/dev/shm")
    return tempfile.mkdtemp(prefix="gpusnap-restore-bench-")


# -- one model ------------------------------------------------------------------------------------
def run_model(spec: Spec, dev: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    build, impl = builder(spec)
    torch.manual_seed(0)
    with torch.device(dev):
        source = build()
    ids = torch.randint(0, 50257, (1, args.prompt), device=dev)
    expected = logits(source, ids)
    nbytes = nbytes_of(source)
    root = pick_root(4 * nbytes, args.root)
    row: dict[str, Any] = {"model": spec.name, "impl": impl, "dtype": str(spec.dtype), "bytes": nbytes, "root": root}
    try:
        ck_dir = os.path.join(root, "gpusnap")
        with gpusnap.Checkpointer(ck_dir, config=gpusnap.Config.from_env(fsync=False)) as ck:
            row["save_s"], _ = timed(dev, lambda: save_while_serving(ck, source, ids))
            progress(spec, "saved", row, "save_s")
            row.update(eager(build, ck, ids, expected, dev, args))
            progress(spec, "eager restores", row, "gpusnap_stream_gbps", "gpusnap_off_gbps")
            row.update(baselines(source, build, ids, expected, dev, root, args))
            progress(spec, "baselines", row, "torch_load_gbps", "safetensors_gbps")
            row.update(cold_start(build, ck, ids, expected, dev, args))
            progress(spec, "cold start", row, "lazy_first_forward_s", "eager_first_forward_s")
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    return row


_T0 = time.perf_counter()


def progress(spec: Spec, phase: str, row: dict[str, Any], *keys: str) -> None:
    """One line per finished phase (a run cut short by a time limit still says how far it got)."""
    shown = ", ".join(f"{k} {row[k]:.3f}" if isinstance(row.get(k), float) else f"{k} {row.get(k)}" for k in keys)
    print(f"[{time.perf_counter() - _T0:.0f} s] {spec.name}: {phase}: {shown}", flush=True)


def save_while_serving(ck: gpusnap.Checkpointer, model: nn.Module, ids: torch.Tensor) -> None:
    """A concurrent save with a forward inside its window, so that the manifest records the
    order the forward touches the weights in (what a lazy restore loads first)."""
    pending = ck.save({"model": model})
    logits(model, ids)
    pending.wait()


def eager(
    build: Callable[[], nn.Module], ck: gpusnap.Checkpointer, ids: torch.Tensor, expected: torch.Tensor,
    dev: torch.device, args: argparse.Namespace,
) -> dict[str, Any]:
    """gpusnap's pipelined restore into an existing model, per verify mode.

    ``stream`` checks on the device where the manifest has device hashes (``verify_path``
    says which path ran; reader processes stage every piece in pinned memory);
    ``stream_direct`` is that with direct copies (``Config.restore_direct_copies="auto"``,
    off by default); ``stream_threads`` without reader processes (reader threads read for
    themselves: the default before the twelfth session);
    ``stream_host`` forces the host BLAKE2b path for comparison.
    Per-stage figures come from the last run's ``handle.stats`` (see ``stage_figures``).
    """
    out: dict[str, Any] = {}
    target = gpusnap.empty_model(build, dev)
    gb = nbytes_of(target) / 1e9
    variants = (("stream", "stream", None, None, None), ("stream_direct", "stream", None, None, "auto"),
                ("stream_threads", "stream", None, "off", "off"),
                ("stream_host", "stream", False, None, None), ("off", "off", None, None, None))
    for label, verify, on_device, procs, direct in variants:
        handles: list[gpusnap.RestoreHandle] = []

        def restore(mode: str = verify, done: list[gpusnap.RestoreHandle] = handles) -> None:
            done.append(ck.restore({"model": target}, verify=mode))  # type: ignore[arg-type]

        saved = restorer_mod.VERIFY_ON_DEVICE, restorer_mod.READER_PROCESSES, restorer_mod.DIRECT_COPIES
        restorer_mod.VERIFY_ON_DEVICE, restorer_mod.READER_PROCESSES, restorer_mod.DIRECT_COPIES = on_device, procs, direct
        try:
            timed(dev, restore)  # untimed: starts what restores keep (regions, reader processes, helpers)
            if ck._restorer._direct is not None:
                ck._restorer._direct.wait_ready()  # (a restore never waits for them: it stages on the host meanwhile)
            secs = best(dev, restore, args.repeat)
        finally:
            restorer_mod.VERIFY_ON_DEVICE, restorer_mod.READER_PROCESSES, restorer_mod.DIRECT_COPIES = saved
        out[f"gpusnap_{label}_s"] = secs
        out[f"gpusnap_{label}_gbps"] = gb / secs
        out["restore_threads"] = handles[-1].stats["threads"]
        out[f"gpusnap_{label}_stages"] = stage_figures(handles[-1].stats)
        out[f"gpusnap_{label}_match"] = torch.equal(logits(target, ids), expected)
    return out


def stage_figures(stats: dict[str, Any]) -> dict[str, Any]:
    """Where a restore's time went: per-stage GB/s (wall-equivalent, thread-seconds / threads)
    and the waits that say which stage was behind (readers waiting for regions: the copies;
    the copy thread idle: the readers; the copy thread waiting for events: the copy engine)."""
    threads = max(1, int(stats.get("threads", 1)))
    nbytes = stats.get("bytes_read", 0)

    def rate(done: float, secs: float) -> float | None:
        return done / secs / 1e9 if secs > 0 else None

    keys = ("verify_path", "reader_procs", "proc_fallbacks", "pieces", "reads", "chunks_read", "region_wait_s", "copy_idle_s", "copy_wait_s",
            "copy_stream_s", "total_s")
    out = {k: stats.get(k) for k in keys}
    out.update(
        read_gbps=rate(nbytes, stats.get("read_s", 0.0) / threads),
        host_verify_gbps=rate(stats.get("host_verified_bytes", 0), stats.get("verify_s", 0.0) / threads),
        copy_stream_gbps=rate(nbytes, stats.get("copy_stream_s", 0.0)),
    )
    return out


def baselines(
    source: nn.Module, build: Callable[[], nn.Module], ids: torch.Tensor, expected: torch.Tensor,
    dev: torch.device, root: str, args: argparse.Namespace,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    gb = nbytes_of(source) / 1e9
    target = gpusnap.empty_model(build, dev)
    path = os.path.join(root, "model.pt")
    torch.save(source.state_dict(), path)

    def torch_load() -> None:
        state = torch.load(path, map_location=dev, weights_only=True)
        target.load_state_dict(state)

    secs = best(dev, torch_load, args.repeat)
    match = torch.equal(logits(target, ids), expected)
    out.update(torch_load_s=secs, torch_load_gbps=gb / secs, torch_load_match=match)
    os.remove(path)
    try:
        from safetensors.torch import load_file, save_model
    except ImportError:
        out["safetensors"] = "not installed"
        return out
    path = os.path.join(root, "model.safetensors")
    save_model(source, path)  # drops tied duplicates

    def st_load() -> None:
        state = load_file(path, device=str(dev))
        target.load_state_dict(state, strict=False)

    secs = best(dev, st_load, args.repeat)
    match = torch.equal(logits(target, ids), expected)
    out.update(safetensors_s=secs, safetensors_gbps=gb / secs, safetensors_match=match)
    os.remove(path)
    return out


def cold_start(
    build: Callable[[], nn.Module], ck: gpusnap.Checkpointer, ids: torch.Tensor, expected: torch.Tensor,
    dev: torch.device, args: argparse.Namespace,
) -> dict[str, Any]:
    """Time from nothing (no model object) to the first forward's logits."""
    out: dict[str, Any] = {}
    lazy_first, eager_first, builds = [], [], []

    def lazy() -> None:
        gc.collect()
        sync(dev)
        t0 = time.perf_counter()
        model, handle = gpusnap.cold_start(build, ck, device=dev)
        returned = time.perf_counter() - t0
        got = logits(model, ids)
        sync(dev)
        lazy_first.append(time.perf_counter() - t0)
        handle.wait()
        out.update(
            lazy_return_s=returned,
            lazy_restore_return_s=handle.stats["return_s"],  # restore() alone, the build left out
            lazy_total_s=handle.stats["total_s"],
            lazy_waits=handle.stats["waits"],
            lazy_wait_s=handle.stats["wait_s"],
            lazy_order=handle.stats.get("order"),
            lazy_match=torch.equal(got, expected),
        )

    def eager_then_forward() -> None:
        gc.collect()
        sync(dev)
        t0 = time.perf_counter()
        model = gpusnap.empty_model(build, dev)
        sync(dev)
        builds.append(time.perf_counter() - t0)
        ck.restore({"model": model})
        logits(model, ids)
        sync(dev)
        eager_first.append(time.perf_counter() - t0)

    for k in range(args.repeat):  # alternated: the one that runs first pays for new device memory
        for step in ((lazy, eager_then_forward) if k % 2 == 0 else (eager_then_forward, lazy)):
            step()
    out.update(lazy_first_forward_s=min(lazy_first), eager_first_forward_s=min(eager_first),
               build_s=min(builds), lazy_first_forward_all_s=lazy_first, eager_first_forward_all_s=eager_first)
    return out


# -- report ---------------------------------------------------------------------------------------
def table(result: dict[str, Any]) -> str:
    def f(v: Any, unit: str = "") -> str:
        if isinstance(v, float):
            return f"{v:.2f}{unit}" if not math.isnan(v) else "-"
        return "-" if v is None else str(v)

    h2d = result.get("h2d_gbps")
    lines = [f"device: {result['device']}  torch {result['torch']}  pinned H2D: {f(h2d, ' GB/s')}"]
    cols = ["model", "GB", "stream GB/s", "direct GB/s", "threads GB/s", "off GB/s", "torch.load GB/s", "safetensors GB/s",
            "lazy 1st fwd s", "eager 1st fwd s", "build s", "lazy return s", "all match"]
    lines.append(" | ".join(cols))
    for r in result["models"]:
        match = all(v for k, v in r.items() if k.endswith("_match"))
        lines.append(" | ".join([
            r["model"], f(r["bytes"] / 1e9), f(r.get("gpusnap_stream_gbps")), f(r.get("gpusnap_stream_direct_gbps")),
            f(r.get("gpusnap_stream_threads_gbps")),
            f(r.get("gpusnap_off_gbps")),
            f(r.get("torch_load_gbps")), f(r.get("safetensors_gbps")), f(r.get("lazy_first_forward_s")),
            f(r.get("eager_first_forward_s")), f(r.get("build_s")), f(r.get("lazy_return_s")), str(match),
        ]))
        if h2d:
            lines.append(f"  {r['model']}: stream {r['gpusnap_stream_gbps'] / h2d:.0%}, stream on host "
                         f"{r['gpusnap_stream_host_gbps'] / h2d:.0%} and off "
                         f"{r['gpusnap_off_gbps'] / h2d:.0%} of pinned H2D ({r['restore_threads']} readers)")
        for label in ("stream", "stream_direct", "stream_threads", "stream_host", "off"):
            st = r.get(f"gpusnap_{label}_stages") or {}
            lines.append(
                f"  {r['model']} {label}: {f(r.get(f'gpusnap_{label}_gbps'), ' GB/s')} verified on "
                f"{st.get('verify_path')}; read {f(st.get('read_gbps'), ' GB/s')}, host verify "
                f"{f(st.get('host_verify_gbps'), ' GB/s')}, copy stream {f(st.get('copy_stream_gbps'), ' GB/s')}; "
                f"{st.get('pieces')} pieces in {st.get('reads')} reads; waits: readers for regions "
                f"{f(st.get('region_wait_s'), ' s')}, copier idle {f(st.get('copy_idle_s'), ' s')}, "
                f"copier on events {f(st.get('copy_wait_s'), ' s')}"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small models: a CPU smoke test")
    ap.add_argument("--out", default="restore_bench.json", help="JSON results")
    ap.add_argument("--root", default=None, help="checkpoint directory (default: under /dev/shm)")
    ap.add_argument("--repeat", type=int, default=2, help="timed runs per measurement (best is kept)")
    ap.add_argument("--prompt", type=int, default=128, help="tokens in the first forward")
    ap.add_argument("--models", default=None, help="comma-separated subset of the model names")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    specs = TINY if args.tiny else FULL
    if args.models:
        specs = [s for s in specs if s.name in args.models.split(",")]
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "h2d_gbps": h2d_gbps(dev, (64 << 20) if args.tiny else (1 << 30)),
        "models": [],
    }
    started = time.perf_counter()
    for spec in specs:
        result["models"].append(run_model(spec, dev, args))
        gc.collect()  # the model of this round is gone before the next one is built
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        print(f"[{time.perf_counter() - started:.0f} s] {spec.name} done", flush=True)
    result["wall_s"] = time.perf_counter() - started
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(table(result))
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
