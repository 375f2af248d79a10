"""A pool process's work before it is asked for anything (:func:`prepare`), and once it is
(:func:`load`). Run in the process, by ``worker.main``.

``prepare``: import torch and the entry's module, create the device's CUDA context, build the
model empty on it (``gpusnap.empty_model``), zero its parameters and run the entry's
warm-up forward, open the Checkpointer. ``load``: restore the asked checkpoint into the
tensors the model already has (``cold_entry.restore_built``: the same entry lookup and
checks as ``gpusnap.cold_start``, eager; from the root's restore server when one serves it,
else from the files), then close the Checkpointer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpusnap.checkpointer import Checkpointer
from gpusnap.cold_entry import restore_built
from gpusnap.config import Config
from gpusnap.pool.entry import EntrySpec, load_entry
from gpusnap.restore.cold import empty_model

__all__ = ["Warm", "load", "prepare"]


@dataclass(frozen=True)
class Warm:
    """A process's built, warmed model and what it needs to load and serve it."""

    serve: Callable[..., Any]
    spec: EntrySpec
    model: nn.Module
    device: torch.device
    ckpt: Checkpointer
    key: str | None
    timings: dict[str, float]


def prepare(start: dict[str, Any], started: float) -> Warm:
    """Everything a take does not depend on; ``started``: ``time.perf_counter()`` before the
    process imported anything. Raises whatever failed (the process then reports it and exits)."""
    serve, spec = load_entry(str(start["entry"]))
    imported = time.perf_counter()
    device = _device(start.get("device"))
    if device.type == "cuda":  # the context now, not at the first request
        torch.cuda.set_device(device)
        torch.empty(1, device=device)
        torch.cuda.synchronize(device)
    cuda_ready = time.perf_counter()
    model = empty_model(spec.build, device)
    if not isinstance(model, nn.Module):
        raise TypeError(f"the entry's build() returned {type(model).__name__}, not a torch.nn.Module")
    model.eval()  # (as from_pretrained returns a model: no dropout while serving)
    with torch.no_grad():  # the warm-up computes on defined values (uninitialised memory may hold NaNs)
        for p in model.parameters():
            p.zero_()
    built = time.perf_counter()
    config = Config(**start["config"]) if start.get("config") else Config.from_env(warm_up_kernels=False)
    ckpt = Checkpointer(start["root"], config=config)
    try:
        if spec.warm_up is not None:
            with torch.no_grad():
                spec.warm_up(model)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    except BaseException:
        ckpt.close()
        raise
    warmed = time.perf_counter()
    timings = {"import_s": imported - started, "cuda_s": cuda_ready - imported, "build_s": built - cuda_ready,
               "warm_up_s": warmed - built}
    return Warm(serve, spec, model, device, ckpt, start.get("key"), timings)


def load(warm: Warm, checkpoint: str | None) -> tuple[str, dict[str, Any]]:
    """Restore ``checkpoint`` (id, tag, None: the newest) into the warm model; returns its id
    and the stats. Every byte is in place and the device idle when it returns."""
    started = time.perf_counter()
    try:
        handle = restore_built(warm.model, warm.ckpt, checkpoint=checkpoint, key=warm.key, lazy=False)
        handle.wait()
        if warm.device.type == "cuda":
            torch.cuda.synchronize(warm.device)
        restored = time.perf_counter()
    finally:
        warm.ckpt.close()  # (a serving process saves nothing: its threads and staging memory go)
    stats = {**handle.stats, **warm.timings, "restore_s": restored - started,
             "close_s": time.perf_counter() - restored}
    return handle.checkpoint_id, stats


def _device(name: Any) -> torch.device:
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"a pool's device is cuda:N or cpu, not {device}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"the pool's device is {device}, but this process sees no CUDA device")
        count = torch.cuda.device_count()
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= count:
            raise RuntimeError(f"the pool's device is {device}, but this process sees {count} CUDA device(s)")
    return device
