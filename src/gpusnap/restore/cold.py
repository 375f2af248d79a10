"""Cold start's pieces: build a model without initialising it (:func:`empty_model`), and warm
it up on a thread of its own while its weights load (:class:`WarmUp`); ``gpusnap.cold_start``
(``gpusnap/cold_entry.py``) restores it lazily through a Checkpointer.

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

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import nn

from gpusnap.handles import RestoreHandle

__all__ = ["WarmUp", "empty_model"]

log = logging.getLogger("gpusnap")

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


class WarmUp:
    """``fn(model)`` on a thread of its own (the program's current device, no autograd)."""

    def __init__(self, fn: Callable[[M], object], model: M, device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:  # ("cuda": the caller's current device)
            device = torch.device("cuda", torch.cuda.current_device())
        self._fn, self._model, self._device = fn, model, device
        self._lock = threading.Lock()
        self._outcome: tuple[str, float] | None = None
        self._handle: RestoreHandle | None = None
        self._waited_s: float | None = None
        # not a daemon: one forward, bounded; a daemon thread still in CUDA at interpreter exit aborts it
        self._thread = threading.Thread(target=self._run, name="gpusnap-warm-up")
        # (before the start: a request right after cold_start returns finds it)
        self._gate = model.register_forward_pre_hook(self._wait_for_warm_up) if isinstance(model, nn.Module) else None
        self._thread.start()

    def _wait_for_warm_up(self, module: nn.Module, args: object) -> None:
        """Forward pre-hook: another thread's call waits until the warm-up has ended."""
        if threading.current_thread() is self._thread:
            return
        started = time.perf_counter()
        self._thread.join()
        with self._lock:
            if self._waited_s is None:
                self._waited_s = time.perf_counter() - started
                if self._handle is not None:
                    self._publish(self._handle)
        self._ungate()

    def _ungate(self) -> None:
        if self._gate is not None:
            self._gate.remove()  # (idempotent)

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)
            with torch.no_grad():
                self._fn(self._model)
            outcome = "ok"
        except Exception as exc:  # (the restore stands; the first request pays the set-up)
            outcome = f"{type(exc).__name__}: {exc}"
            log.warning("gpusnap: cold_start's warm_up failed (the restore goes on): %s", outcome)
        with self._lock:
            self._outcome = (outcome, time.perf_counter() - started)
            if self._handle is not None:
                self._publish(self._handle)
        self._ungate()  # (calls from now on run at once)

    def report_to(self, handle: RestoreHandle) -> None:
        with self._lock:
            self._handle = handle
            handle.stats.setdefault("warm_up", "running")
            self._publish(handle)

    def _publish(self, handle: RestoreHandle) -> None:
        """What is known so far into ``handle.stats`` (under ``_lock``)."""
        if self._outcome is not None:
            handle.stats["warm_up"], handle.stats["warm_up_s"] = self._outcome
        if self._waited_s is not None:
            handle.stats["warm_up_waited_s"] = self._waited_s

    def join(self) -> None:
        self._thread.join()
