"""Dotted names for export: a nested dict (``gpusnap.load``'s) flattened as a state_dict is.

``{"model": {"layer.weight": w}, "optim": {"state": {0: {"exp_avg": m}}}, "step": 3}`` becomes
``model.layer.weight``, ``optim.state.0.exp_avg`` and ``step``: the keys of every dict, list
and tuple on the way to a tensor joined by ``.`` (int keys and list indices in decimal).
A container holding no tensor is one plain value under its own name (``optim.param_groups``),
as restore treats it. When ``keys`` selects one dict, module or Stateful entry, names are
relative to it (``model`` exported alone gives ``layer.weight``: its state_dict), unless
``full_names``. A key that is not a ``str`` or ``int`` has no dotted name, and two key
paths that would share one name (``"a.b"`` and ``a`` -> ``b``, int ``0`` and str ``"0"``) make
the export fail naming both: select around them with ``keys``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gpusnap.interop.errors import FormatError
from gpusnap.restore.key_select import Selector

__all__ = ["dotted_names", "selected"]


def dotted_names(state: Mapping[Any, Any]) -> dict[str, Any]:
    """``name -> tensor or plain value`` for every leaf of ``state``, in walk order."""
    out: dict[str, Any] = {}
    origin: dict[str, tuple[Any, ...]] = {}
    for key, value in state.items():
        _visit(value, (key,), out, origin)
    return out


def _visit(value: Any, at: tuple[Any, ...], out: dict[str, Any], origin: dict[str, tuple[Any, ...]]) -> None:
    if isinstance(value, (dict, list, tuple)) and _holds_tensor(value):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            _visit(item, at + (key,), out, origin)
        return
    bad = next((k for k in at if type(k) not in (str, int)), None)
    if bad is not None:
        raise FormatError(
            f"{at!r}: key {bad!r} ({type(bad).__name__}) has no dotted name; only str and int keys do. "
            "Leave this entry out with keys=[...] (a tuple of keys names it, e.g. in gpusnap.load)"
        )
    name = ".".join(str(k) for k in at)
    if name in origin:
        raise FormatError(
            f"{origin[name]!r} and {at!r} would both be named {name!r}; export one of them at a time "
            "with keys=[...] (tuples of keys tell them apart)"
        )
    origin[name] = at
    out[name] = value.detach() if isinstance(value, torch.Tensor) else value


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def selected(state: Mapping[Any, Any], selector: Selector) -> Any:
    """The entry one selector chose in ``gpusnap.load``'s result (which holds that one branch
    only), followed key by key as the selector names them."""
    here: Any = state
    rest = selector
    while True:
        ((key, here),) = here.items()
        if isinstance(rest, tuple):
            rest = rest[1:]
        else:  # the key's text, then a separator (key_select matched it so)
            rest = rest[len(str(key)) + 1:]
        if not rest:
            return here
