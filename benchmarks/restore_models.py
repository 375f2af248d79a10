"""The inference models the restore benchmarks load, and what they share.

GPT-2 large (fp32) and a larger inference-only GPT-2 (bf16), from transformers' ``GPT2Config``
with random weights; a small built-in GPT stands in where transformers is missing. Used by
``fresh_cold_start.py`` (and its child processes) and ``restore_diagnosis.py``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import gpusnap
from gpusnap.bench.system import sync

__all__ = ["FULL", "TINY", "Spec", "builder", "h2d_gbps", "logits", "nbytes_of", "pick_root", "save_while_serving",
           "sync"]


@dataclass(frozen=True)
class Spec:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    dtype: torch.dtype


FULL = [Spec("gpt2-large", 36, 1280, 20, torch.float32), Spec("gpt2-2.7b-bf16", 32, 2560, 20, torch.bfloat16)]
TINY = [Spec("tiny", 2, 64, 2, torch.float32), Spec("tiny-bf16", 4, 128, 4, torch.bfloat16)]


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
    """Bytes of the model's state, each storage once (tied weights)."""
    seen: set[int] = set()
    total = 0
    for t in model.state_dict().values():
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def h2d_gbps(dev: torch.device, nbytes: int) -> float | None:
    """Best of three pinned host-to-device copies of ``nbytes``: the ceiling of any restore."""
    if dev.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst.copy_(src, non_blocking=True)
    best = float("inf")
    for _ in range(3):
        sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def pick_root(need: int, wanted: str | None) -> str:
    """``wanted``, else a new folder on /dev/shm when it has ``need`` bytes free, else in /tmp."""
    if wanted:
        return wanted
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > need:
        return tempfile.mkdtemp(prefix="gpusnap-restore-bench-", dir="/dev/shm")
    return tempfile.mkdtemp(prefix="gpusnap-restore-bench-")


def save_while_serving(ck: gpusnap.Checkpointer, model: nn.Module, ids: torch.Tensor) -> None:
    """A concurrent save with a forward inside its window, so that the manifest records the
    order the forward touches the weights in (what a lazy restore loads first)."""
    pending = ck.save({"model": model})
    logits(model, ids)
    pending.wait()
