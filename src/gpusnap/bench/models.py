"""A small GPT-style decoder in plain torch: the decode workload's model, and the training
fallback when ``transformers`` is not installed (so CI smoke-tests the bench without it).

The decode path writes keys and values into preallocated per-layer cache tensors
``[2, batch, heads, max_len, head_dim]``: the cache lives in ``app_state``, so a checkpoint
includes it, and each step writes one new position ("growing" the used part) instead of
allocating new tensors, which is how serving engines keep it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["MiniGPT"]


class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.out = nn.Linear(4 * n_embd, n_embd)

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        shape = (b, t, self.n_head, c // self.n_head)
        return tuple(z.view(shape).transpose(1, 2) for z in (q, k, v))  # type: ignore[return-value]

    def _merge(self, y: torch.Tensor) -> torch.Tensor:
        b, h, t, d = y.shape
        return self.proj(y.transpose(1, 2).reshape(b, t, h * d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._heads(self.ln1(x))
        x = x + self._merge(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

    def decode(self, x: torch.Tensor, cache: torch.Tensor, pos: int) -> torch.Tensor:
        """One new position; ``cache`` is this layer's ``[2, batch, heads, max_len, head_dim]``."""
        q, k, v = self._heads(self.ln1(x))
        cache[0, :, :, pos : pos + 1].copy_(k)
        cache[1, :, :, pos : pos + 1].copy_(v)
        keys, values = cache[0, :, :, : pos + 1], cache[1, :, :, : pos + 1]
        x = x + self._merge(F.scaled_dot_product_attention(q, keys, values))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class MiniGPT(nn.Module):
    """GPT-2 shaped (pre-LayerNorm blocks, tied embedding and head), without ``transformers``."""

    def __init__(self, *, n_layer: int, n_embd: int, n_head: int, vocab: int, max_len: int) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not a multiple of n_head={n_head}")
        self.n_layer, self.n_embd, self.n_head, self.vocab, self.max_len = n_layer, n_embd, n_head, vocab, max_len
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(max_len, n_embd)
        self.blocks = nn.ModuleList(_Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)
        self.head.weight = self.wte.weight
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02 / math.sqrt(1 if p is self.wte.weight else n_layer))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for every position (training, causal)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))

    def new_cache(self, batch: int, *, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        """One ``[2, batch, heads, max_len, head_dim]`` tensor per layer."""
        shape = (2, batch, self.n_head, self.max_len, self.n_embd // self.n_head)
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.n_layer)]

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, cache: Sequence[torch.Tensor], pos: int) -> torch.Tensor:
        """Greedy next token for ``tokens`` ``[batch, 1]`` at position ``pos``; writes the cache."""
        x = self.wte(tokens) + self.wpe.weight[pos]
        for i, block in enumerate(self.blocks):
            x = block.decode(x, cache[i], pos)
        return self.head(self.ln_f(x))[:, -1].argmax(dim=-1, keepdim=True)
