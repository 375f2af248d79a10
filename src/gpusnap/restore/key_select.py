"""Key selectors of ``gpusnap.load(keys=...)`` and ``gpusnap.export(keys=...)``: which
entries of a checkpoint tree a selector names, decided on the decoded keys, never on how
they print.

A selector is either

- a **string**, a dotted path: ``"model"``, ``"optim.state"``, ``"model.0.weight"`` (``/``
  separates as well as ``.``). Each component names a ``str`` key equal to it or an ``int``
  key whose decimal text it is. A key may itself hold ``.`` or ``/``: ``"layer.weight"``
  names a top-level key ``"layer.weight"`` as well as ``layer`` -> ``weight``. A string that
  names more than one entry (int ``1`` and str ``"1"``, or ``"a.b"`` and ``a`` -> ``b``) is
  an :class:`AmbiguousKeyError`: use a tuple;
- a **tuple of keys**, one per level, compared by value and exact type:
  ``("optim", "state", 0)`` (int 0, not str ``"0"``), ``("a/b",)``, ``(("x", 1),)`` for a
  tuple key. Every key, of any plain type, can be named this way.

Selection descends through dicts, modules (their state_dict entries) and Stateful values
(their state_dict); a selected entry comes whole, with everything below it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Union

from gpusnap.errors import CheckpointError

__all__ = ["AmbiguousKeyError", "KeyPath", "Selector", "ambiguity", "covers", "leads_to", "match", "normalize"]

Selector = Union[str, tuple[Any, ...]]
"""A dotted string or a tuple of keys (see the module docstring)."""

KeyPath = tuple[tuple[type, Any], ...]
"""A decoded key path, each key with its exact type (so that ``1``, ``True`` and ``1.0`` differ)."""

Children = Callable[[dict[str, Any], str], "list[tuple[Any, dict[str, Any], str]] | None"]
"""``(node, path) -> [(key, child node, child path), ...]``, or None where selection cannot descend."""


class AmbiguousKeyError(CheckpointError, ValueError):
    """A string selector names more than one entry; the message lists them and says to pass a tuple."""


def normalize(keys: Sequence[Selector] | str | None) -> tuple[Selector, ...] | None:
    """``keys`` as a tuple of selectors; ValueError for an empty selection or a bad selector.

    A bare string is one selector; any other sequence (a list, or a tuple of strings as
    before tuples of keys existed) holds one selector per item, so a tuple of keys goes in a
    list: ``keys=[("optim", "state", 0)]``.
    """
    if keys is None:
        return None
    chosen = (keys,) if isinstance(keys, str) else tuple(keys)
    if not chosen:
        raise ValueError("keys selects nothing: pass None for every entry, or prefixes such as ['model']")
    for key in chosen:
        if isinstance(key, str) and key.strip("./"):
            continue
        if isinstance(key, tuple) and key:
            continue
        raise ValueError(
            "keys must be non-empty dotted strings ('model', 'optim.state') or non-empty tuples of keys "
            f"(('optim', 'state', 0)), got {key!r}"
        )
    return tuple(k.strip("./") if isinstance(k, str) else k for k in chosen)


def match(selector: Selector, node: dict[str, Any], children: Children) -> list[KeyPath]:
    """Every key path below ``node`` that ``selector`` names (none, one, or several)."""
    found: list[KeyPath] = []
    _walk(selector, node, "", (), children, found)
    return found


def _walk(rest: Selector, node: dict[str, Any], path: str, at: KeyPath, children: Children,
          found: list[KeyPath]) -> None:
    items = children(node, path)
    for key, child, child_path in items or ():
        here = at + ((type(key), key),)
        if isinstance(rest, tuple):
            head = rest[0]
            if type(key) is type(head) and key == head:
                if len(rest) == 1:
                    found.append(here)
                else:
                    _walk(rest[1:], child, child_path, here, children, found)
            continue
        text = _text(key)
        if text is None or not rest.startswith(text):
            continue
        after = rest[len(text):]
        if not after:
            found.append(here)
        elif after[0] in "./" and after[1:]:
            _walk(after[1:], child, child_path, here, children, found)


def _text(key: Any) -> str | None:
    """What a string selector's component must equal to name ``key`` (None: only a tuple can)."""
    if type(key) is str:
        return key
    if type(key) is int:
        return str(key)
    return None


def covers(chosen: Sequence[KeyPath], at: KeyPath) -> bool:
    """``at`` is a chosen entry or inside one."""
    return any(at[: len(c)] == c for c in chosen)


def leads_to(chosen: Sequence[KeyPath], at: KeyPath) -> bool:
    """Some chosen entry lies strictly below ``at``."""
    return any(len(c) > len(at) and c[: len(at)] == at for c in chosen)


def ambiguity(selector: Selector, found: list[KeyPath], where: str) -> AmbiguousKeyError:
    """The error for a string selector that names several entries."""
    named = ", ".join(repr(tuple(k for _, k in p)) for p in found)
    return AmbiguousKeyError(
        f"key {selector!r} names {len(found)} entries in {where}: {named}; pass the one meant as a tuple of keys, "
        f"e.g. keys=[{tuple(k for _, k in found[0])!r}]"
    )
