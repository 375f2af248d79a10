"""The ``llama`` workload: a Llama-style ~0.95B decoder trained the way current recipes train.

fp32 weights, bf16 autocast for forward and backward, ``torch.optim.AdamW(fused=True)`` on
CUDA (fused AdamW is CUDA-only, so the CPU smoke test steps a plain AdamW in fp32). The model
comes from ``transformers``' ``LlamaConfig`` / ``LlamaForCausalLM`` (config-built, random
init); without ``transformers`` :class:`MiniLlama`, the same shapes in plain torch, stands in.

Shape (``full`` and ``quick``): hidden 2048, 16 layers, 16 query heads of 128, 4 key/value
heads (grouped-query attention, the Llama 3 ratio of 4 queries per key/value head), SwiGLU
MLP of 6656, vocabulary 32000, untied head: 0.953B parameters, ~11.4 GB of training state
(weights plus two Adam moments). The 5504-wide MLP sized for full multi-head attention gives
0.94B; with 4 key/value heads 6656 brings it back to ~0.95B.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["LLAMA_SIZES", "MiniLlama", "build_llama"]

# hidden, layers, heads, kv heads, MLP width, vocabulary, batch, sequence length
LLAMA_SIZES = {
    "full": (2048, 16, 16, 4, 6656, 32000, 8, 1024),
    "quick": (2048, 16, 16, 4, 6656, 32000, 4, 1024),
    "tiny": (64, 2, 4, 2, 172, 512, 2, 32),
}


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()  # in fp32 under autocast too, as Llama's reference does
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class _Layer(nn.Module):
    def __init__(self, d: int, heads: int, kv: int, mlp: int) -> None:
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, d // heads
        self.input_layernorm = _RMSNorm(d)
        self.q_proj = nn.Linear(d, heads * self.hd, bias=False)
        self.k_proj = nn.Linear(d, kv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, kv * self.hd, bias=False)
        self.o_proj = nn.Linear(heads * self.hd, d, bias=False)
        self.post_attention_layernorm = _RMSNorm(d)
        self.gate_proj = nn.Linear(d, mlp, bias=False)
        self.up_proj = nn.Linear(d, mlp, bias=False)
        self.down_proj = nn.Linear(mlp, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.kv, self.hd).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        rep = self.heads // self.kv  # (repeat_interleave: SDPA's enable_gqa needs torch 2.5)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class MiniLlama(nn.Module):
    """Llama-shaped (RMSNorm, rotary positions, grouped-query attention, SwiGLU, untied
    head), parameter for parameter the shapes of ``LlamaForCausalLM``, without ``transformers``."""

    def __init__(self, *, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, vocab: int) -> None:
        super().__init__()
        if hidden % heads or heads % kv_heads:
            raise ValueError(f"hidden={hidden}, heads={heads}, kv_heads={kv_heads} do not divide")
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(_Layer(hidden, heads, kv_heads, mlp) for _ in range(layers))
        self.norm = _RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.head_dim = hidden // heads
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def _rope(self, t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        inv = 1.0 / (10000.0 ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim))
        angles = torch.outer(torch.arange(t, device=device).float(), inv)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        cos, sin = self._rope(inputs.shape[1], inputs.device)
        x = self.embed_tokens(inputs)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def build_llama(
    device: torch.device, size: str, batch: int | None, seq: int | None, *, use_transformers: bool
) -> tuple[Any, ...]:
    """(model, loss function, optimizer, data, impl, config) for ``size`` on ``device``;
    ``transformers``' model where ``use_transformers``, else :class:`MiniLlama`."""
    hidden, layers, heads, kv, mlp, vocab, b, s = LLAMA_SIZES[size]
    b, s = batch or b, seq or s
    cuda = device.type == "cuda"
    with torch.device(device):  # initialising on the device: a 0.95B random init is slow on a CPU
        if use_transformers:
            from transformers import LlamaConfig, LlamaForCausalLM

            cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                              num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=max(2048, s),
                              tie_word_embeddings=False)
            model: nn.Module = LlamaForCausalLM(cfg).float()
            impl = "transformers LlamaForCausalLM (config-built, random init)"

            def loss(tokens: torch.Tensor) -> torch.Tensor:
                return model(input_ids=tokens, labels=tokens, use_cache=False).loss  # type: ignore[no-any-return]
        else:
            mini = MiniLlama(hidden=hidden, layers=layers, heads=heads, kv_heads=kv, mlp=mlp, vocab=vocab)
            model, loss = mini, mini.loss
            impl = "gpusnap.bench MiniLlama (Llama shaped; transformers not installed)"
        data = torch.randint(0, vocab, (b, s))
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    config = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "intermediate_size": mlp, "vocab": vocab, "batch": b, "seq": s,
              "params": sum(p.numel() for p in model.parameters()), "weights": "float32",
              "autocast": "bfloat16" if cuda else "off (CPU)", "optimizer": "AdamW fused" if cuda else "AdamW",
              "size": size}
    return model, loss, optim, data, impl, config
