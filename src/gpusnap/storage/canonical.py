"""Canonical JSON: the bytes a manifest's checksum covers, and encoding them with little Python.

``canonical_json`` is ``json.dumps`` with sorted keys, compact separators, ASCII and no NaN.
A fast-tier save commits a manifest of thousands of chunks on the writer thread, whose
Python takes the interpreter lock from the training thread, so two helpers build the same
bytes from parts: :func:`join_object` splices values encoded apart into one object, and
:class:`TreeCodes` keeps the encoding of each app_state tree node from one manifest to the
next. A planned flatten (state/flatten.py) hands out the same node objects, read only,
while the state keeps its layout, so only what changed (plain values, the containers
around them) is encoded again.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["TreeCodes", "canonical_json", "join_object"]


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON (sorted keys, compact, ASCII, no NaN): the bytes the checksum covers."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("ascii")


def _text(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def join_object(encoded: dict[str, str]) -> str:
    """The canonical JSON of an object whose values are given already encoded (canonically)."""
    return "{" + ",".join(f"{_text(k)}:{encoded[k]}" for k in sorted(encoded)) + "}"


class TreeCodes:
    """Canonical JSON of trees, remembering each dict node's encoding by identity until the
    next :meth:`encode` (which keeps those it met again, and the new ones).

    Sound only for nodes nobody changes once encoded: a manifest's tree is read only (the
    planned flatten's contract); each remembered node is held, so its id is never reused
    meanwhile. Gives exactly :func:`canonical_json`'s text.

    >>> codes = TreeCodes()
    >>> leaf = {"t": "tensor", "shape": (2, 3)}
    >>> codes.encode({"t": "dict", "items": [leaf]}) == canonical_json({"t": "dict", "items": [leaf]}).decode()
    True
    """

    def __init__(self) -> None:
        self._known: dict[int, tuple[dict[str, Any], str]] = {}

    def encode(self, tree: Any) -> str:
        seen: dict[int, tuple[dict[str, Any], str]] = {}
        try:
            return self._encode(tree, seen)
        finally:
            self._known = seen

    def _encode(self, node: Any, seen: dict[int, tuple[dict[str, Any], str]]) -> str:
        kind = type(node)
        if kind is dict:
            key = id(node)
            hit = self._known.get(key) or seen.get(key)
            if hit is not None and hit[0] is node:
                seen[key] = hit
                return hit[1]
            if not all(type(k) is str for k in node) or not any(map(_nested, node.values())):
                text = _text(node)  # (a leaf: one C call; keys that are not all str: json's own rules)
            else:
                text = "{" + ",".join(f"{_text(k)}:{self._encode(node[k], seen)}" for k in sorted(node)) + "}"
            seen[key] = (node, text)
            return text
        if _nested(node):
            return "[" + ",".join(self._encode(v, seen) for v in node) + "]"
        return _text(node)


def _nested(value: Any) -> bool:
    """Whether ``value`` holds containers whose encoding may be remembered (a dict, or a
    list/tuple of containers); anything else is encoded in one C call."""
    kind = type(value)
    return kind is dict or ((kind is list or kind is tuple) and any(type(v) in (dict, list, tuple) for v in value))
