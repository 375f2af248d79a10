"""``gpusnap.cold_start``: a model built empty and restored lazily from a Checkpointer's
checkpoint, serving before every byte is back (the pieces are ``restore/cold.py``'s)."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any, TypeVar

import torch
from torch import nn

from gpusnap.checkpointer import Checkpointer, resolve_checkpoint
from gpusnap.errors import RestoreMismatchError
from gpusnap.handles import RestoreHandle
from gpusnap.restore.cold import WarmUp, empty_model
from gpusnap.restore.model_entry import ModelEntry, locate
from gpusnap.restore.rank_view import rank_view

__all__ = ["cold_start", "restore_built"]

M = TypeVar("M", bound=nn.Module)


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
    found, state = _prepare(model, ckpt, checkpoint, key, app_state)
    warming = WarmUp(warm_up, model, torch.device(device)) if warm_up is not None else None
    try:  # (strict=False: the entry's keys were checked above; the checkpoint's other keys are skipped)
        handle = ckpt.restore(state, found, lazy=True, strict=False)
    except BaseException:
        if warming is not None:  # (the model is not served: nothing may go on reading it)
            warming.join()
        raise
    if warming is not None:
        warming.report_to(handle)
    return model, handle


def restore_built(model: nn.Module, ckpt: Checkpointer, *, checkpoint: str | None = None, key: str | None = None,
                  app_state: MutableMapping[str, Any] | None = None, lazy: bool = False) -> RestoreHandle:
    """Restore ``model``, already built (``empty_model``) and maybe already run, in place from
    ``checkpoint``, its entry found as :func:`cold_start` finds it (the same checks, before
    any byte moves); eager unless ``lazy``. The warm process pool (``gpusnap.pool``) loads
    its processes' models this way: their tensors, and the kernels a warm-up loaded for
    them, stay where they are.

    >>> handle = restore_built(model, ckpt)        # every byte in place on return  # doctest: +SKIP
    """
    found, state = _prepare(model, ckpt, checkpoint, key, app_state)
    return ckpt.restore(state, found, lazy=lazy, strict=False)


def _prepare(model: nn.Module, ckpt: Checkpointer, checkpoint: str | None, key: str | None,
             app_state: MutableMapping[str, Any] | None) -> tuple[str, MutableMapping[str, Any]]:
    """The checkpoint's id (pinned) and what ``ckpt.restore`` fills, every check made."""
    found, tree, where = _resolve(ckpt, checkpoint)
    entry = locate(tree, model, key=key, allow_pickle=ckpt.allow_pickle, where=where)
    return found, _targets(model, entry, app_state, where)


def _resolve(ckpt: Checkpointer, checkpoint: str | None) -> tuple[str, dict[str, Any], str]:
    """The id of the checkpoint to restore (pinned: the restore reads that one), its tree, and
    how errors name it. ``"latest"`` counts this process's pending saves, as restore's does."""
    ckpt.wait()
    repo, manifest, skipped = resolve_checkpoint(ckpt, checkpoint)
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
