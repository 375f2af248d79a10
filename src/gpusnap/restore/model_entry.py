"""Which entry of a checkpoint holds a model's state_dict (``cold_start``), and which of the
model's keys it may lack.

A training checkpoint holds the model beside ``optim``, ``step`` and ``rng``; ``gpusnap
import`` puts a state_dict file's tensors under ``--key`` or at the top level; and a
``save_pretrained`` directory leaves tied weights out (``lm_head.weight`` is
``embed_tokens.weight``: safetensors refuses shared tensors, ``from_pretrained`` ties them
back). So the model's entries are found by name (``key``, else ``"model"`` when the
checkpoint has it), else by content: the one top-level entry, or the root itself, whose keys
are the model's state_dict keys. A model key the checkpoint lacks is fine when its tensor is
the very tensor of a key it has (tied, as ``empty_model`` keeps ties): filled through that
key, it comes back tied. Any other key on one side only is a RestoreMismatchError, raised
before a byte moves: an unfilled parameter of an empty model would hold garbage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpusnap.errors import RestoreMismatchError
from gpusnap.restore.template_free import UnknownKeyError
from gpusnap.state.apply import Planner
from gpusnap.state.nodes import node_child, node_kind

__all__ = ["DEFAULT_KEY", "ModelEntry", "locate"]

DEFAULT_KEY = "model"
"""The entry tried first when no ``key`` is given (``Checkpointer`` users' usual name)."""

_SHOWN = 8  # keys listed in an error message


@dataclass(frozen=True)
class ModelEntry:
    """Where the model's entries are: ``key`` (a top-level key) or, when None, the
    checkpoint's root (a bare state_dict); ``top_keys``: the checkpoint's top-level keys."""

    key: Any | None
    top_keys: tuple[Any, ...]


def locate(tree: dict[str, Any], model: nn.Module, *, key: str | None, allow_pickle: bool, where: str) -> ModelEntry:
    """The entry of checkpoint ``tree`` that restores ``model`` (``where`` names the
    checkpoint in errors); UnknownKeyError for a ``key`` it lacks, RestoreMismatchError when
    no entry (or more than one) fits."""
    decoder = Planner([], allow_pickle)
    if node_kind(tree, "") != "dict":
        raise RestoreMismatchError(f"{where}: its tree is not a dict at the root")
    top = decoder.keyed(tree, "")
    names = tuple(k for k, _ in top)
    live = model.state_dict(keep_vars=True)
    if key is None and DEFAULT_KEY in names:
        key = DEFAULT_KEY
    if key is not None:
        node = dict(top).get(key)
        if node is None:
            raise UnknownKeyError(f"key {key!r} names nothing in {where}; its top-level keys are {_show(names)}")
        keys = _entry_keys(decoder, node, str(key))
        if keys is None:
            held = node_kind(node, str(key))
            raise RestoreMismatchError(f"{where}: {key!r} holds a {held!r}, not a module's state_dict; "
                                       "pass key= naming the entry that holds the model")
        _fit(keys, live, f"{where}, entry {key!r}")
        return ModelEntry(key, names)
    candidates: list[tuple[Any | None, list[Any]]] = [(None, list(names))]  # (None: the root, a bare state_dict)
    candidates += [(k, keys) for k, node in top if (keys := _entry_keys(decoder, node, str(k))) is not None]
    fitting = [(k, keys) for k, keys in candidates if _misfit(keys, live) == 0]
    if len(fitting) == 1:
        return ModelEntry(fitting[0][0], names)
    if fitting:
        named = ", ".join(_label(k) for k, _ in fitting)
        raise RestoreMismatchError(f"{where}: several entries hold this model's keys ({named}): pass key= to choose")
    shared = [(k, keys) for k, keys in candidates if any(key in live for key in keys)]
    if shared:  # the keys that keep the closest entry from fitting say what went wrong
        closest, keys = min(shared, key=lambda c: _misfit(c[1], live))
        _fit(keys, live, f"{where} ({_label(closest)}, the entry closest to the model's keys)")
    raise RestoreMismatchError(
        f"{where}: no entry holds this model's state_dict (keys such as {_show(list(live))}); its top-level keys are "
        f"{_show(names)}: pass key= naming the entry that holds the model, or build the model it was saved from"
    )


def _entry_keys(decoder: Planner, node: dict[str, Any], path: str) -> list[Any] | None:
    """The keys of a module's entries or of a dict (an imported state_dict); None otherwise."""
    kind = node_kind(node, path)
    if kind == "module":
        node = node_child(node, "entries", path)
    elif kind != "dict":
        return None
    return [k for k, _ in decoder.keyed(node, path)]


def _gaps(keys: list[Any], live: Mapping[str, Any]) -> tuple[list[str], list[Any]]:
    """(model keys the checkpoint lacks, tied ones aside; checkpoint keys the model lacks)."""
    present = set(keys)
    filled = {id(t) for k, t in live.items() if k in present and isinstance(t, torch.Tensor)}
    missing = [k for k, t in live.items() if k not in present and not (isinstance(t, torch.Tensor) and id(t) in filled)]
    return missing, [k for k in keys if k not in live]


def _misfit(keys: list[Any], live: Mapping[str, Any]) -> int:
    """How many keys are on one side only (0: the entry fits)."""
    missing, unexpected = _gaps(keys, live)
    return len(missing) + len(unexpected)


def _label(key: Any | None) -> str:
    return "the checkpoint's root" if key is None else f"entry {key!r}"


def _fit(keys: list[Any], live: Mapping[str, Any], where: str) -> None:
    """RestoreMismatchError naming the keys on one side only, if any (tied ones aside)."""
    missing, unexpected = _gaps(keys, live)
    problems = []
    if missing:
        problems.append(f"keys in the model but not in the checkpoint: {_show(missing)}")
    if unexpected:
        problems.append(f"keys in the checkpoint but not in the model: {_show(unexpected)}")
    if problems:
        raise RestoreMismatchError(
            f"{where} does not fit the model; nothing was restored:\n" + "\n".join(f"  - {p}" for p in problems)
            + "\n(build the model the checkpoint was saved from; a key the checkpoint leaves out is accepted only "
            "when the model ties it to one it has)"
        )


def _show(keys: list[Any] | tuple[Any, ...]) -> str:
    shown = repr(list(keys[:_SHOWN]))
    return shown if len(keys) <= _SHOWN else f"{shown[:-1]}, ... ({len(keys)} in all)]"
