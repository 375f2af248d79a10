"""Entry modules for the pool tests (``test_pool*.py``): the pool's processes import this file
(the pool passes them the test's ``sys.path``).

``serve``: a small tied-embedding model (parameters made without initialisation, so a
process starts fast); a take's params say what to do: ``ids`` (logits to compute),
``marker`` (a file the entry creates first: it ran), ``out`` (a file the result goes to:
what ``gpusnap serve --pool`` users read, since the server's pool returns no value), ``hold``
(wait until stopped), ``spawn`` (a command the entry starts first).
``serve_hf``: a Hugging Face causal LM from the ``config.json`` in
``$POOL_TEST_HF_DIR``. ``undecorated``: an entry that declares no model.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from typing import Any

import torch
from torch import nn

from one_thread import one_thread

import gpusnap.pool

VOCAB, DIM, CTX = 64, 32, 16


class SmallLM(nn.Module):
    """An embedding, a few mixing layers over a causal mask (a non-persistent buffer), and an
    output layer tied to the embedding. ``dim`` changes every shape: another model."""

    def __init__(self, dim: int = DIM, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Parameter(torch.empty(VOCAB, dim))
        self.mixers = nn.ParameterList(nn.Parameter(torch.empty(dim, dim)) for _ in range(layers))
        self.register_buffer("mask", torch.tril(torch.ones(CTX, CTX)), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb[ids]
        n = ids.shape[-1]
        mix = self.mask[:n, :n] / self.mask[:n, :n].sum(-1, keepdim=True)
        for w in self.mixers:
            h = h + torch.tanh(mix @ h @ w)
        return h @ self.emb.t()


def trained(seed: int, dim: int = DIM) -> SmallLM:
    """A SmallLM with random weights from ``seed``."""
    torch.manual_seed(seed)
    model = SmallLM(dim)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model.eval()


def _warm_up(model: nn.Module) -> None:
    model(torch.zeros(1, 8, dtype=torch.long, device=next(model.parameters()).device))


def _logits(model: nn.Module, ids: list[list[int]], device: torch.device) -> torch.Tensor:
    """On one CPU thread: a pool's process and the test's own then give the same bits whatever
    thread counts they run with (a CPU matmul's sums are split by thread; a test before may
    have left the test process at one)."""
    with one_thread(), torch.no_grad():
        out = model(torch.tensor(ids, device=device))
    return getattr(out, "logits", out).float().cpu()


def reference_logits(model: nn.Module, ids: list[list[int]]) -> torch.Tensor:
    """The logits the tests compare a served process's with, computed the way it computes them."""
    return _logits(model, ids, next(model.parameters()).device)


def _write(path: str, value: Any) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(value, f)


def _answer(ready: gpusnap.pool.Ready) -> dict[str, Any] | None:
    params = ready.params
    if "spawn" in params:
        subprocess.Popen(params["spawn"])  # (a helper of the entry's own)
    if "marker" in params:
        _write(params["marker"], {"pid": os.getpid()})
    if "holding" in params:  # (a FIFO the test reads: it then knows this ran before it stops us)
        with open(params["holding"], "w") as f:
            f.write(str(os.getpid()))
    if params.get("hold"):
        threading.Event().wait()  # (until a signal ends the process)
    model = ready.model
    result = {"checkpoint": ready.checkpoint, "source": ready.stats.get("source"), "pid": os.getpid(),
              "training": model.training}
    if hasattr(model, "get_input_embeddings"):  # (a Hugging Face model: are its embeddings tied?)
        result["tied"] = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if "ids" in params:
        result["logits"] = _logits(ready.model, params["ids"], ready.device).tolist()
    if "out" in params:
        _write(params["out"], result)
    return result


@gpusnap.pool.entry(build=SmallLM, warm_up=_warm_up)
def serve(ready: gpusnap.pool.Ready) -> dict[str, Any] | None:
    return _answer(ready)


def undecorated(ready: gpusnap.pool.Ready) -> None:
    raise AssertionError("never called: it declares no model")


# -- Hugging Face ------------------------------------------------------------------------------

def build_hf() -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(os.environ["POOL_TEST_HF_DIR"]))


@gpusnap.pool.entry(build=build_hf, warm_up=_warm_up)
def serve_hf(ready: gpusnap.pool.Ready) -> dict[str, Any] | None:
    return _answer(ready)
