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

import logging
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from gpusnap.errors import RestoreMismatchError
from gpusnap.handles import RestoreHandle
from gpusnap.restore.model_entry import ModelEntry, locate
from gpusnap.restore.rank_view import rank_view

if TYPE_CHECKING:
    from gpusnap.checkpointer import Checkpointer

__all__ = ["cold_start", "empty_model"]

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


def cold_start(
    build: Callable[[], M],
    ckpt: Checkpointer,
    *,
    device: torch.device | str,
    checkpoint: str | None = None,
    key: str | None = None,
    app_state: MutableMapping[str, Any] | None = None,
    warm_up: Callable[[M], object] | None = None,
) -> tuple[M, RestoreHandle]:
    """Build the model empty on ``device`` and restore it lazily; returns at once.

    The model's entries are the checkpoint's ``key`` entry; without ``key``, its ``"model"``
    entry if it has one, else the one entry (or the checkpoint itself, as ``gpusnap import``
    without ``--key`` stores a state_dict) whose keys are the model's state_dict keys. Only
    the chunks the model needs are read; the checkpoint's other keys (``optim``, ``step``,
    ``rng`` of a training checkpoint) are skipped and listed in ``handle.stats["unexpected"]``.
    A model key the checkpoint lacks is accepted only when the model ties it to a key the
    checkpoint has (``lm_head.weight`` of a ``save_pretrained`` directory with tied
    embeddings): it comes back tied, listed in ``handle.stats["missing"]``. Any other key on
    one side only is a :class:`~gpusnap.RestoreMismatchError`, raised before any byte moves.

    ``app_state``, if given, holds other top-level keys of the checkpoint to restore too, as
    ``Checkpointer.restore(strict=False)`` would (its plain values are replaced on return);
    the model goes under the key it was found at. The first forward waits only for the
    weights it reaches, in the order the checkpointed program used them.

    ``warm_up(model)``, if given, runs once under ``torch.no_grad()`` on a thread of its own
    as soon as the model is built, while its weights load; its result is discarded. A fresh
    process's first forward pays set-up that does not depend on the weights (cuBLAS handles,
    loading kernels, first-call Python); the warm-up pays it while bytes move, so the first
    request does not. It reads weights that are still arriving, so it must write none of the
    model's tensors: give it an input shaped like a request's. A call of the model from another
    thread while the warm-up runs waits for it to end first (the two together each paid the
    set-up: a fresh process's first request came later than after the warm-up alone), so the
    warm-up must not itself wait for such a call. ``handle.stats["warm_up"]`` is
    ``"running"``, then ``"ok"`` or the error (also a WARNING); ``["warm_up_s"]`` its time,
    ``["warm_up_waited_s"]`` how long a first call waited for it.

    >>> model, handle = gpusnap.cold_start(lambda: GPT(cfg), ckpt, device="cuda")  # doctest: +SKIP
    >>> logits = model(tokens)        # serves before the whole checkpoint is loaded  # doctest: +SKIP
    """
    model = empty_model(build, device)
    found, tree, where = _resolve(ckpt, checkpoint)
    entry = locate(tree, model, key=key, allow_pickle=ckpt.allow_pickle, where=where)
    state = _targets(model, entry, app_state, where)
    warming = _WarmUp(warm_up, model, torch.device(device)) if warm_up is not None else None
    try:  # (strict=False: the entry's keys were checked above; the checkpoint's other keys are skipped)
        handle = ckpt.restore(state, found, lazy=True, strict=False)
    except BaseException:
        if warming is not None:  # (the model is not served: nothing may go on reading it)
            warming.join()
        raise
    if warming is not None:
        warming.report_to(handle)
    return model, handle


def _resolve(ckpt: Checkpointer, checkpoint: str | None) -> tuple[str, dict[str, Any], str]:
    """The id of the checkpoint to restore (pinned: the restore reads that one), its tree, and
    how errors name it. ``"latest"`` counts this process's pending saves, as restore's does."""
    ckpt.wait()
    repo, manifest, skipped = ckpt._resolve(checkpoint)
    repo.warn_unreadable(skipped, f"cold_start() used the older checkpoint {manifest.id} instead")
    found = manifest.id
    if manifest.ranks:  # distributed: every rank's part has the same keys; rank 0's tree says them
        repo, manifest = rank_view(repo, manifest, rank=0, world_size=1)
    return found, manifest.tree, f"checkpoint {found} of {ckpt.root}"


def _targets(model: nn.Module, entry: ModelEntry, app_state: MutableMapping[str, Any] | None,
             where: str) -> MutableMapping[str, Any]:
    """What ``ckpt.restore`` fills: ``app_state`` with the model under its key, or for a
    checkpoint that is the model's bare state_dict, the model's own tensors by name."""
    state: MutableMapping[str, Any] = app_state if app_state is not None else {}
    if entry.key is None:
        if state:
            raise RestoreMismatchError(f"{where} is the model's state_dict alone: it has no keys {list(state)!r} "
                                       "for app_state; leave app_state out")
        named = dict(model.state_dict(keep_vars=True))  # (a tied key the file lacks: filled through its twin)
        other = [k for k, v in named.items() if not isinstance(v, torch.Tensor)]
        if other:  # (only the module's load_state_dict takes extra state; a dict would just replace it)
            raise RestoreMismatchError(f"{where} is a bare state_dict, and the model has extra state {other!r}: "
                                       "import the file under a key (`gpusnap import PATH ROOT --key model`)")
        return named
    absent = [k for k in state if k != entry.key and k not in entry.top_keys]
    if absent:
        raise RestoreMismatchError(f"app_state keys {absent!r} are not in {where}; its top-level keys are "
                                   f"{list(entry.top_keys)!r}")
    state[entry.key] = model
    return state


class _WarmUp:
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
