"""One fresh process of ``cold_start_serve.py``: import, initialise CUDA, then (timed) build the
model and produce its first logits through one loading path; print one ``RESULT {json}`` line.

Run by the parent only: ``python cold_start_serve_child.py KIND WORK DEVICE``. ``WORK`` holds
what the parent saved: ``config.json``, ``hf/`` (``save_pretrained``), ``model.safetensors``,
``model.pt``, ``ck/`` (gpusnap), ``ids.pt`` and ``expected.pt`` (the source model's logits).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

started = time.perf_counter()
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM  # (imports are not timed)

import gpusnap

# the build empty_model does
from gpusnap.restore.cold import _parameters_on_meta as parameters_on_meta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cold_start_serve import build_model


def flatten_parameters(model: nn.Module, device: torch.device) -> None:
    """Every parameter becomes a view of one device buffer (512-byte aligned pieces): the
    server then opens one IPC handle for the whole model, not one per caching-allocator segment."""
    params = list({id(p): p for p in model.parameters()}.values())
    sizes = [-(-p.numel() * p.element_size() // 512) * 512 for p in params]
    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    at = 0
    for p, n in zip(params, sizes):
        p.data = flat[at : at + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
        at += n


def assign(model: nn.Module, state: dict[str, torch.Tensor], device: torch.device) -> None:
    """``load_state_dict(assign=True)``; a tied name a file left out (safetensors keeps one
    name per shared tensor) gets its partner's tensor."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for group in names.values():
        present = [n for n in group if n in state]
        for n in group:
            if present and n not in state:
                state[n] = state[present[0]]
    model.load_state_dict(state, assign=True)
    model.tie_weights()
    model.to(device)  # (the buffers; parameters are there already)


def from_pretrained(work: str, device: torch.device, stats: dict[str, Any]) -> nn.Module:
    hf = os.path.join(work, "hf")
    dtype = {"dtype": torch.bfloat16}
    try:
        try:
            model = LlamaForCausalLM.from_pretrained(hf, device_map=str(device), **dtype)
        except TypeError:  # (transformers 4: torch_dtype)
            dtype = {"torch_dtype": torch.bfloat16}
            model = LlamaForCausalLM.from_pretrained(hf, device_map=str(device), **dtype)
        stats["how"] = "device_map"
    except ValueError as exc:  # (device_map needs accelerate)
        if "accelerate" not in str(exc):
            raise
        model = LlamaForCausalLM.from_pretrained(hf, **dtype).to(device)
        stats["how"] = "to(device): accelerate is not installed"
    return model.eval()


def main() -> None:
    kind, work, dev_name = sys.argv[1], sys.argv[2], sys.argv[3]
    device = torch.device(dev_name)
    marks: dict[str, float] = {}
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)
        torch.cuda.synchronize(device)
    ids = torch.load(os.path.join(work, "ids.pt")).to(device)
    expected = torch.load(os.path.join(work, "expected.pt"))
    cfg = LlamaConfig.from_json_file(os.path.join(work, "config.json"))

    def build() -> nn.Module:
        return build_model(cfg)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    t0 = time.perf_counter()
    marks["imports_s"] = t0 - started

    def mark(name: str) -> None:
        marks[name] = time.perf_counter() - t0

    stats: dict[str, Any] = {}
    config = gpusnap.Config.from_env(fsync=False, warm_up_kernels=False,
                                     restore_from_server="on" if kind.startswith("server") else "off")
    if kind == "from_pretrained":
        model = from_pretrained(work, device, stats)
    elif kind in ("load_file", "torch_load"):
        with parameters_on_meta():
            model = build()
        mark("built")
        if kind == "load_file":
            from safetensors.torch import load_file

            state = load_file(os.path.join(work, "model.safetensors"), device=str(device))
        else:
            state = torch.load(os.path.join(work, "model.pt"), mmap=True, weights_only=True, map_location=device)
        mark("loaded")
        assign(model, state, device)
    else:
        with gpusnap.Checkpointer(os.path.join(work, "ck"), config=config) as ck:
            if kind in ("lazy", "server"):
                model, handle = gpusnap.cold_start(build, ck, device=device)
            elif kind in ("lazy-warm", "server-warm"):
                model, handle = gpusnap.cold_start(build, ck, device=device,
                                                   warm_up=lambda m: m(input_ids=ids, use_cache=False))
            else:
                model = gpusnap.empty_model(build, device)
                if kind == "server-flat":
                    flatten_parameters(model, device)
                mark("built")
                handle = ck.restore({"model": model})
            mark("restore_returned")
            logits = run(model, ids, sync)
            mark("first_logits")
            handle.wait()
            mark("restore_done")
            run(model, ids, sync)
            mark("second_logits")
            stats = {k: handle.stats.get(k) for k in ("source", "served", "server_fallback", "mode", "verify_path",
                                                      "return_s", "total_s", "setup", "reader_procs", "warm_up",
                                                      "warm_up_s", "warm_up_waited_s")}
    if "first_logits" not in marks:
        mark("restore_returned")
        logits = run(model, ids, sync)
        mark("first_logits")
        run(model, ids, sync)
        mark("second_logits")
    out = logits.float().cpu()
    diff = float((out - expected.float()).abs().max())
    print("RESULT " + json.dumps({"kind": kind, "marks": marks, "stats": stats, "equal": bool(torch.equal(logits.cpu(), expected)),
                                  "max_abs_diff": diff}, default=str), flush=True)


def run(model: nn.Module, ids: torch.Tensor, sync: Callable[[], None]) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False).logits
    sync()
    return out


if __name__ == "__main__":
    main()
