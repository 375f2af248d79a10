"""A small entry module for the pool, as a user's looks (docs/pool.md runs it on CPU):
``gpusnap serve ROOT --pool 1 --entry gpusnap.pool.demo:serve``.

The model is :class:`TinyLM` (tied embeddings, a non-persistent causal mask: what
``empty_model`` must get right); ``demo.save(root)`` saves one to serve. A take's
``params["tokens"]`` is a prompt; the entry answers with the next token after each prompt
position and how long this process took from the take to its first logits.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

from gpusnap.pool.entry import entry
from gpusnap.pool.ready import Ready

__all__ = ["TinyLM", "build", "save", "serve", "warm_up"]

VOCAB = 64
PROMPT = 8  # the warm-up's prompt length: a serving shape


class TinyLM(nn.Module):
    """An embedding, a few mixing layers over a causal mask, and an output layer tied to the
    embedding."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, layers: int = 2, ctx: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("mask", torch.tril(torch.ones(ctx, ctx)), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        n = ids.shape[-1]
        mix = self.mask[:n, :n] / self.mask[:n, :n].sum(-1, keepdim=True)
        for block in self.blocks:
            h = h + torch.tanh(block(mix @ h))
        return self.head(h)


def build() -> TinyLM:
    return TinyLM()


def warm_up(model: TinyLM) -> None:
    model(torch.zeros(1, PROMPT, dtype=torch.long, device=model.emb.weight.device))


@entry(build=build, warm_up=warm_up)
def serve(ready: Ready) -> dict[str, Any]:
    """Answer one prompt (``params["tokens"]``), then return."""
    tokens = torch.tensor([ready.params.get("tokens", [1, 2, 3])], device=ready.device)
    with torch.no_grad():
        logits = ready.model(tokens)
    if ready.device.type == "cuda":
        torch.cuda.synchronize(ready.device)
    return {"next": logits.argmax(-1)[0].tolist(), "weights_to_logits_s": time.perf_counter() - ready.asked_at,
            "source": ready.stats.get("source"), "pid": os.getpid()}


def save(root: str | os.PathLike[str], *, seed: int = 0) -> str:
    """Save a TinyLM with random weights (``seed``) under ``"model"`` in ``root``; its id."""
    from gpusnap.checkpointer import Checkpointer

    torch.manual_seed(seed)
    with Checkpointer(root) as ckpt:
        return ckpt.save({"model": TinyLM()}, blocking=True).wait().id
