"""Walking a manifest tree (the nodes :mod:`gpusnap.state.flatten` makes) without a live
state: its leaves with their key paths, a copy with some leaves replaced, and the
*signature* of its structure (what ranks of a collective save must agree on).

Containers are ``dict`` (``items``: ``[[key node, value node], ...]``), ``list`` and
``tuple`` (``items``), ``module`` (``entries``) and ``stateful`` (``state``); everything
else is a leaf (a ``tensor``, a ``dtensor``, a plain value).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from gpusnap.kernels.hashing import chunk_digest

from .plain import join_path

__all__ = ["leaves", "replace_leaves", "signature_lines", "signature"]

_INNER = {"module": "entries", "stateful": "state"}


def _key(key_node: Any) -> str:
    return str(key_node.get("v")) if isinstance(key_node, dict) and "v" in key_node else str(key_node)


def leaves(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """``(path, node)`` of every leaf under ``node``, in tree order."""
    kind = node.get("t")
    if kind == "dict" and isinstance(node.get("items"), list):
        for key_node, child in node["items"]:
            yield from leaves(child, join_path(path, _key(key_node)))
    elif kind in ("list", "tuple") and isinstance(node.get("items"), list):
        for i, child in enumerate(node["items"]):
            yield from leaves(child, join_path(path, i))
    elif kind in _INNER and isinstance(node.get(_INNER[kind]), dict):
        yield from leaves(node[_INNER[kind]], path)
    else:
        yield path, node


def replace_leaves(
    node: dict[str, Any], new: Callable[[str, dict[str, Any]], dict[str, Any] | None], path: str = ""
) -> dict[str, Any]:
    """A copy of ``node`` in which each leaf for which ``new(path, leaf)`` is not None is
    replaced by it; containers on the way are copied, the rest shared (trees are read only)."""
    kind = node.get("t")
    if kind == "dict" and isinstance(node.get("items"), list):
        items = [[k, replace_leaves(c, new, join_path(path, _key(k)))] for k, c in node["items"]]
        return {**node, "items": items}
    if kind in ("list", "tuple") and isinstance(node.get("items"), list):
        return {**node, "items": [replace_leaves(c, new, join_path(path, i)) for i, c in enumerate(node["items"])]}
    if kind in _INNER and isinstance(node.get(_INNER[kind]), dict):
        return {**node, _INNER[kind]: replace_leaves(node[_INNER[kind]], new, path)}
    replaced = new(path, node)
    return node if replaced is None else replaced


def signature_lines(tree: dict[str, Any]) -> list[str]:
    """One line per leaf: its path, kind, and for tensors dtype and (global) shape. Ranks of
    one collective save must have the same lines (a DTensor's local shape may differ)."""
    out = []
    for path, leaf in leaves(tree):
        kind = leaf.get("t")
        if kind in ("tensor", "dtensor"):
            out.append(f"{path or '<root>'}: {kind} {leaf.get('dtype')} {list(leaf.get('shape', ()))}")
        else:
            out.append(f"{path or '<root>'}: {kind}")
    return out


def signature(tree: dict[str, Any]) -> str:
    """A digest of :func:`signature_lines`: what one rank's part tells rank 0 (O(1) bytes)."""
    return chunk_digest("\n".join(signature_lines(tree)).encode())
