"""Cold start: build a model without initialising it, restore it lazily, serve before all is back.

The plain recipe needs no helper::

    with torch.device("meta"):
        model = build()                  # shapes only: no memory, no init kernels
    model.to_empty(device="cuda")        # uninitialised memory, every byte comes from the checkpoint
    handle = ckpt.restore({"model": model}, lazy=True)
    out = model(x)                       # waits only for the weights it touches, in order

Two things go wrong with it for some models, and :func:`empty_model` avoids both:

- buffers registered with ``persistent=False`` (causal masks, rotary ``inv_freq``) are not in
  the state_dict, so not in the checkpoint; after ``to_empty`` they hold garbage. Here only
  parameters skip initialisation: buffers are built for real (they are small).
- ``to_empty`` unties tied parameters (each module gets its own copy); the restore then fills
  both copies, correct but twice the memory. Here ties are kept.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from gpusnap.handles import RestoreHandle

if TYPE_CHECKING:
    from gpusnap.checkpointer import Checkpointer

__all__ = ["cold_start", "empty_model"]

M = TypeVar("M", bound=nn.Module)
_PATCH = threading.RLock()


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every Parameter registered meanwhile moves to the meta device, so initialising it after
    registration (the usual ``reset_parameters`` / ``post_init``) costs nothing.

    Patches ``nn.Module.register_parameter`` for the duration (as accelerate's
    ``init_empty_weights(include_buffers=False)`` does): modules built meanwhile on other
    threads are affected too.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    with _PATCH:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
        try:
            yield
        finally:
            nn.Module.register_parameter = original  # type: ignore[method-assign]


def empty_model(build: Callable[[], M], device: torch.device | str) -> M:
    """``build()`` with uninitialised parameters on ``device``; buffers real, ties kept.

    >>> m = empty_model(lambda: torch.nn.Linear(4, 2), "cpu")
    >>> m.weight.device.type, m.weight.is_meta
    ('cpu', False)
    """
    with _parameters_on_meta():
        model = build()
    _materialize(model, torch.device(device))
    return model


def _materialize(model: nn.Module, device: torch.device) -> None:
    params: dict[int, nn.Parameter] = {}
    buffers: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            made = params.get(id(p))
            if made is None:
                data = torch.empty_like(p, device=device) if p.is_meta else p.detach().to(device)
                made = params[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
            module._parameters[name] = made
        for name, b in module._buffers.items():
            if b is None:
                continue
            moved = buffers.get(id(b))
            if moved is None:
                moved = buffers[id(b)] = torch.empty_like(b, device=device) if b.is_meta else b.to(device)
            module._buffers[name] = moved


def cold_start(
    build: Callable[[], M],
    ckpt: Checkpointer,
    *,
    device: torch.device | str,
    checkpoint: str | None = None,
    key: str = "model",
    app_state: MutableMapping[str, Any] | None = None,
) -> tuple[M, RestoreHandle]:
    """Build the model empty on ``device`` and restore it lazily; returns at once.

    ``app_state`` holds the checkpoint's other keys if it has any (its plain values are
    replaced on return); the model goes under ``key``. The first forward waits only for the
    weights it reaches, in the order the checkpointed program used them.

    >>> model, handle = gpusnap.cold_start(lambda: GPT(cfg), ckpt, device="cuda")  # doctest: +SKIP
    >>> logits = model(tokens)        # serves before the whole checkpoint is loaded  # doctest: +SKIP
    """
    model = empty_model(build, device)
    state: MutableMapping[str, Any] = app_state if app_state is not None else {}
    state[key] = model
    handle = ckpt.restore(state, checkpoint, lazy=True)
    return model, handle
