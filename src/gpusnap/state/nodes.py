"""Nodes of a checkpoint's manifest tree, checked as they are read: their kind, a child, the
items, an int, and whether a subtree is plain (restored as one value).
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError
from .plain import PLAIN_KINDS

__all__ = ["is_plain_node", "node_child", "node_int", "node_items", "node_kind"]


def node_kind(node: Any, path: str) -> str:
    """The node's kind (its ``"t"``); CheckpointError for a malformed node."""
    kind = node.get("t") if isinstance(node, dict) else None
    if not isinstance(kind, str):
        raise CheckpointError(f"{path or '<root>'}: malformed checkpoint node {str(node)[:80]!r}")
    return kind


def node_child(node: dict[str, Any], field: str, path: str) -> dict[str, Any]:
    """The node's child node ``field``; CheckpointError if it has none."""
    child = node.get(field)
    if not isinstance(child, dict):
        raise CheckpointError(f"{path or '<root>'}: a {node['t']!r} node has no {field!r}")
    return child


def node_items(node: dict[str, Any], path: str) -> list[Any]:
    """The node's ``items`` list; CheckpointError if it has none."""
    items = node.get("items")
    if not isinstance(items, list):
        raise CheckpointError(f"{path or '<root>'}: malformed {node['t']!r} node")
    return items


def node_int(value: Any) -> int:
    """``value`` if it is an int (not a bool); TypeError otherwise."""
    if type(value) is not int:
        raise TypeError(f"expected an int, got {value!r}")
    return value


def is_plain_node(node: Any) -> bool:
    """True when the subtree holds no tensor or object: it is restored as one value.

    Malformed parts count as plain so that :func:`decode_plain` reports them.
    """
    if not isinstance(node, dict):
        return True
    kind, items = node.get("t"), node.get("items")
    if kind in ("dict", "list", "tuple") and isinstance(items, list):
        if kind == "dict":
            items = [p[1] for p in items if isinstance(p, (list, tuple)) and len(p) == 2]
        return all(is_plain_node(v) for v in items)
    return kind in PLAIN_KINDS

