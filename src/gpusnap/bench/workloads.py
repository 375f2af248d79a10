"""The programs the bench checkpoints: GPT-2 small/large, Llama ~0.95B and ResNet-50 training,
LLM decode.

A :class:`Workload` is a live program: its ``app_state`` (what gpusnap saves), a ``step``
that advances it by one training step or one decoded token and returns its loss (the
decoded tokens) as a device tensor, not read (the caller reads it, as a real loop reads
``loss.item()``), and :meth:`Workload.tensors`,
the flat name -> tensor dict every baseline saves (the same bytes gpusnap saves, without
the plain values). ``transformers`` and ``torchvision`` are imported only when a workload
needs them; without ``transformers`` the GPT-2 workloads use :class:`MiniGPT` and ``llama``
:class:`~gpusnap.bench.llama.MiniLlama`, the same shapes.

Sizes come in three presets: ``full`` (the published suite), ``quick`` (``--quick`` on a
GPU: fits the 10-minute budget) and ``tiny`` (CPU smoke tests; not a performance figure).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import gpusnap
from gpusnap.bench.llama import build_llama
from gpusnap.bench.models import MiniGPT

__all__ = ["SIZES", "WORKLOADS", "Hook", "Workload", "build_workload", "size_for"]

Hook = Callable[[], None]
"""Called by ``step`` just before its first write to checkpointed state (DCP async waits
for its staging copy there: the earliest moment a real training loop would have to)."""

WORKLOADS = ("gpt2", "gpt2-large", "llama", "resnet50", "decode")
SIZES = ("tiny", "quick", "full")

# n_layer, n_embd, n_head; batch and sequence length; GPT-2 vocabulary.
_GPT = {
    "gpt2": {"full": (12, 768, 12, 8, 512), "quick": (12, 768, 12, 8, 512), "tiny": (2, 64, 2, 2, 32)},
    "gpt2-large": {"full": (36, 1280, 20, 8, 512), "quick": (36, 1280, 20, 4, 512), "tiny": (2, 96, 2, 2, 32)},
}
_GPT_VOCAB = {"full": 50257, "quick": 50257, "tiny": 512}
# n_layer, n_embd, n_head, batch, max_len; bf16 weights: full ~5.2 GB + 1.6 GB KV cache,
# quick ~2.1 GB + 0.4 GB KV cache.
_DECODE = {
    "full": (12, 4096, 32, 8, 2048, 50304),
    "quick": (8, 3072, 24, 8, 1024, 50304),
    "tiny": (2, 64, 2, 2, 64, 512),
}
_RESNET = {"full": (64, 224), "quick": (32, 224), "tiny": (2, 32)}


@dataclass
class Workload:
    """One live program. ``step(hook)`` runs a step; ``hook`` precedes its first state write."""

    name: str
    kind: str  # "training" or "inference"
    device: torch.device
    app_state: dict[str, Any]
    step: Callable[[Hook | None], torch.Tensor | None]
    impl: str
    config: dict[str, Any] = field(default_factory=dict)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every checkpointed tensor by name, one entry per storage (tied weights once)."""
        out: dict[str, torch.Tensor] = {}
        seen: set[tuple[int, str]] = set()

        def add(name: str, t: torch.Tensor) -> None:
            key = (t.untyped_storage().data_ptr(), str(t.device))
            if key not in seen:
                seen.add(key)
                out[name] = t.detach()

        for name, t in self.app_state["model"].state_dict().items():
            add(f"model.{name}", t)
        optim = self.app_state.get("optim")
        if optim is not None:
            for gi, group in enumerate(optim.param_groups):
                for pi, p in enumerate(group["params"]):
                    for k, v in optim.state.get(p, {}).items():
                        if isinstance(v, torch.Tensor):
                            add(f"optim.{gi}.{pi}.{k}", v)
        for i, t in enumerate(self.app_state.get("kv", [])):
            add(f"kv.{i}", t)
        if "tokens" in self.app_state:
            add("tokens", self.app_state["tokens"])
        return out

    def state_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.tensors().values())


def size_for(device: torch.device, quick: bool) -> str:
    if device.type == "cpu":
        return "tiny"
    return "quick" if quick else "full"


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def missing_reason(name: str) -> str | None:
    """Why a workload cannot run here, or None."""
    if name == "resnet50" and not have("torchvision"):
        return "torchvision is not installed"
    return None


def build_workload(
    name: str,
    device: torch.device,
    *,
    size: str,
    seed: int = 0,
    batch: int | None = None,
    seq: int | None = None,
) -> Workload:
    """Builds ``name`` at ``size`` on ``device``; ``seed`` varies weights (fresh restore targets)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    torch.manual_seed(seed)
    if name in _GPT:
        return _gpt(name, device, size, batch, seq)
    if name == "llama":
        return _llama(device, size, batch, seq)
    if name == "resnet50":
        return _resnet(device, size, batch, seq)
    return _decode(device, size, batch, seq)


def _train_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model, "optim": optim, "rng": gpusnap.RNGState(), "step": 0}


def _gpt(name: str, device: torch.device, size: str, batch: int | None, seq: int | None) -> Workload:
    n_layer, n_embd, n_head, b, s = _GPT[name][size]
    b, s = batch or b, seq or s
    vocab = _GPT_VOCAB[size]
    # Initialising on the device: GPT-2 large's random init takes tens of seconds on a CPU.
    with torch.device(device):
        if have("transformers"):
            from transformers import GPT2Config, GPT2LMHeadModel

            cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=max(1024, s), vocab_size=vocab)
            model: nn.Module = GPT2LMHeadModel(cfg)
            impl = "transformers GPT2LMHeadModel (config-built, random init)"

            def loss(tokens: torch.Tensor) -> torch.Tensor:
                return model(input_ids=tokens, labels=tokens).loss  # type: ignore[no-any-return]
        else:
            mini = MiniGPT(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab=vocab, max_len=max(1024, s))
            model = mini
            impl = "gpusnap.bench MiniGPT (GPT-2 shaped; transformers not installed)"
            loss = mini.loss
        data = torch.randint(0, vocab, (b, s))
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = _train_state(model, optim)

    def step(hook: Hook | None = None) -> torch.Tensor:
        out = loss(data)
        out.backward()
        if hook is not None:  # forward and backward write no checkpointed tensor
            hook()
        optim.step()
        optim.zero_grad(set_to_none=True)
        state["step"] += 1
        return out.detach()

    config = {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "batch": b, "seq": s, "vocab": vocab,
              "dtype": "float32", "optimizer": "AdamW", "size": size}
    return _primed(Workload(name, "training", device, state, step, impl, config))


def _llama(device: torch.device, size: str, batch: int | None, seq: int | None) -> Workload:
    model, loss, optim, data, impl, config = build_llama(device, size, batch, seq, use_transformers=have("transformers"))
    state = _train_state(model, optim)
    cuda = device.type == "cuda"  # bf16 autocast on CUDA only: CPU bf16 matmuls are slow

    def step(hook: Hook | None = None) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            out = loss(data)
        out.backward()
        if hook is not None:  # forward and backward write no checkpointed tensor
            hook()
        optim.step()
        optim.zero_grad(set_to_none=True)
        state["step"] += 1
        return out.detach()

    return _primed(Workload("llama", "training", device, state, step, impl, config))


def _resnet(device: torch.device, size: str, batch: int | None, image: int | None) -> Workload:
    import torchvision

    b, px = _RESNET[size]
    b, px = batch or b, image or px
    with torch.device(device):
        model = torchvision.models.resnet50(weights=None)
        images = torch.randn(b, 3, px, px)
        labels = torch.randint(0, 1000, (b,))
    model.train()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = _train_state(model, optim)

    def step(hook: Hook | None = None) -> torch.Tensor:
        if hook is not None:  # BatchNorm running statistics are written by the forward
            hook()
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        state["step"] += 1
        return loss.detach()

    config = {"batch": b, "image": px, "dtype": "float32", "optimizer": "SGD momentum", "size": size}
    return _primed(Workload("resnet50", "training", device, state, step, "torchvision resnet50 (random init)", config))


def _decode(device: torch.device, size: str, batch: int | None, max_len: int | None) -> Workload:
    n_layer, n_embd, n_head, b, L, vocab = _DECODE[size]
    b, L = batch or b, max_len or L
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = MiniGPT(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab=vocab, max_len=L).to(dtype)
        model.eval().requires_grad_(False)
        kv = model.new_cache(b, dtype=dtype, device=device)  # one tensor per layer
        start = L // 2
        # A prompt of L/2 positions "already processed": the cache's first half is filled,
        # so every decode step attends over L/2..L keys and the used part grows from there.
        for t in kv:
            t[:, :, :, :start].normal_()
        tokens = torch.randint(0, vocab, (b, L))
    state: dict[str, Any] = {"model": model, "kv": kv, "tokens": tokens, "pos": start}

    def step(hook: Hook | None = None) -> torch.Tensor:
        if hook is not None:
            hook()
        pos = state["pos"]
        nxt = model.decode_step(tokens[:, pos : pos + 1], kv, pos)
        tokens[:, pos + 1 : pos + 2].copy_(nxt)
        state["pos"] = pos + 1 if pos + 2 < L else start  # wrap: keep the prompt, decode again
        return nxt

    config = {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "batch": b, "max_len": L, "vocab": vocab,
              "dtype": str(dtype).replace("torch.", ""), "size": size, "frozen_weights": True}
    return Workload("decode", "inference", device, state, step, "gpusnap.bench MiniGPT decode, per-layer KV cache", config)


def _primed(wl: Workload) -> Workload:
    """One step, so optimizer state exists (and is checkpointed) from the first save on."""
    wl.step(None)
    wl.app_state["step"] = 0
    return wl
