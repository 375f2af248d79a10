"""What ``show`` says about a checkpoint: its tensors and plain values by key path, with long
values summarized (``<bytes 5.0 KiB>``, ``<625 ints>``). Reads the manifest tree only: nothing
is unpickled, no tensor byte is read.

Key paths are those of the library's messages (``optim/state/0/exp_avg``): dict keys and list
indices joined by ``/``; modules and stateful objects add no component of their own. Where two
distinct paths would print alike (int ``0`` and str ``"0"``, a key ``"a/b"`` and ``a`` ->
``b``), each of them prints its keys exactly instead (``'0'``, ``0``, ``'a/b'``, ``[0]``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from gpusnap.cli.render import human_bytes
from gpusnap.errors import CheckpointError
from gpusnap.state.plain import decode_plain, dtype_from_name
from gpusnap.storage.manifest import Manifest, canonical_json

__all__ = ["Entry", "TensorRow", "ValueRow", "entries", "keyed_entries", "summarize", "tensor_itemsize", "tensor_nbytes", "value_text"]

WIDTH = 72
"""Longest value text shown on one line; a longer container is split by key, or summarized."""
_CONTAINERS = ("module", "stateful", "dict", "list", "tuple")
_TENSORS = ("tensor", "dtensor")


@dataclass(frozen=True)
class TensorRow:
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int | None
    device: str
    requires_grad: bool


@dataclass(frozen=True)
class ValueRow:
    key: str
    kind: str
    text: str


def summarize(manifest: Manifest) -> tuple[list[TensorRow], list[ValueRow]]:
    """Every tensor, and every plain value (split by key where a container is too long)."""
    tensors: list[TensorRow] = []
    values: list[ValueRow] = []
    for key, node in entries(manifest):
        if node.get("t") in _TENSORS:
            tensors.append(_tensor_row(key, node))
        else:
            values.append(ValueRow(key, str(node.get("t")), value_text(node)))
    return tensors, values


@dataclass(frozen=True)
class Entry:
    """A tensor or plain value as ``show`` lists it: ``path`` identifies it (one part per key,
    the key's exact node, so int ``0`` and str ``"0"`` differ), ``key`` is how it prints."""

    path: tuple[str, ...]
    key: str
    node: dict[str, Any]


def entries(manifest: Manifest) -> list[tuple[str, dict[str, Any]]]:
    """``(key path, node)`` of every tensor and every plain value, as ``show`` lists them."""
    return [(e.key, e.node) for e in keyed_entries(manifest)[0]]


def keyed_entries(*manifests: Manifest) -> list[list[Entry]]:
    """The entries of each manifest, printed so that no two distinct paths among all of them
    print alike: a key path whose plain text another path shares (``0`` and ``"0"``, a key
    ``"a/b"`` and ``a`` -> ``b``) prints each key exactly (``'0'``, ``0``, ``'a/b'``, ``[0]``
    for a list index)."""
    walked = [list(_entries(m.tree, (), (), ())) for m in manifests]
    owners: dict[str, set[tuple[str, ...]]] = {}
    for rows in walked:
        for path, plain, _exact, _node in rows:
            owners.setdefault("/".join(plain), set()).add(path)
    return [
        [Entry(path, "/".join(exact if len(owners["/".join(plain)]) > 1 else plain), node)
         for path, plain, exact, node in rows]
        for rows in walked
    ]


_Row = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], dict[str, Any]]


def _entries(node: dict[str, Any], path: tuple[str, ...], plain: tuple[str, ...],
             exact: tuple[str, ...]) -> Iterator[_Row]:
    """``(path, plain texts, exact texts, node)`` for each tensor and each plain value short
    enough for one line."""
    for ident, text, exact_text, child in _children(node):
        row = (path + (ident,), plain + (text,), exact + (exact_text,))
        kind = child.get("t")
        if kind in _TENSORS:
            yield *row, child
        elif kind in _CONTAINERS and (_has_tensor(child) or _splittable(child)):
            yield from _entries(child, *row)
        else:
            yield *row, child


def _children(node: dict[str, Any]) -> list[tuple[str, str, str, dict[str, Any]]]:
    """``(identity, plain text, exact text, child)`` of each key of a container."""
    kind = node.get("t")
    if kind == "module":
        return _children(node["entries"])
    if kind == "stateful":
        return _children(node["state"])
    if kind == "dict":
        return [(canonical_json(k).decode("ascii"), _key_text(k), _exact_key_text(k), v) for k, v in node["items"]]
    if kind in ("list", "tuple"):
        return [(f"[{i}]", str(i), f"[{i}]", v) for i, v in enumerate(node["items"])]
    return []


def _has_tensor(node: dict[str, Any]) -> bool:
    kind = node.get("t")
    if kind in _TENSORS:
        return True
    return kind in _CONTAINERS and any(_has_tensor(c[-1]) for c in _children(node))


def _splittable(node: dict[str, Any]) -> bool:
    """Whether a plain container gets one line per item rather than one line: when it does
    not fit in full, and it is a dict or a short sequence holding a dict (named things, as an
    optimizer's ``param_groups``). A long sequence of numbers is summarized instead."""
    if node.get("t") in ("module", "stateful"):
        return True
    if _full_text(node) is not None:
        return False
    if node["t"] == "dict":
        return True
    items = node["items"]
    return len(items) <= 8 and any(i.get("t") in ("dict", "module", "stateful") for i in items)


def _key_text(node: dict[str, Any]) -> str:
    kind = node.get("t")
    if kind in ("v", "float", "dtype", "device"):
        return str(node.get("v"))
    return _exact_key_text(node)


def _exact_key_text(node: dict[str, Any]) -> str:
    """The key as Python writes it (``'0'``, ``0``, ``('x', 1)``); never unpickles."""
    if node.get("t") == "pickle":
        return "<pickle>"
    try:
        return repr(decode_plain(node, "", False))
    except CheckpointError:
        return f"<{node.get('t')}>"


def value_text(node: dict[str, Any]) -> str:
    """A plain value as compact Python-like text: in full when it fits on a line, else with
    long strings, bytes and containers summarized (``<bytes 5.0 KiB>``, ``<625 ints>``)."""
    kind = node.get("t")
    value = node.get("v")
    if kind == "v":
        if isinstance(value, str) and len(value) > 40:
            return f"{value[:32]!r}... <str of {len(value)} chars>"
        return repr(value)
    if kind == "float":
        return f"float({str(value)!r})"
    if kind == "bytes":
        return f"<bytes {human_bytes(_b64_length(str(value)))}>"
    if kind == "dtype":
        return f"torch.{value}"
    if kind == "device":
        return f"device({str(value)!r})"
    if kind == "size":
        return f"torch.Size({list(value or [])})"
    if kind == "pickle":
        return f"<pickled object, {human_bytes(_b64_length(str(value)))}, not loaded>"
    if kind in ("list", "tuple", "dict"):
        return _container_text(node)
    if kind == "tensor":
        return f"<tensor {node.get('dtype')}{list(node.get('shape', []))}>"
    return f"<{kind}>"


def _container_text(node: dict[str, Any]) -> str:
    """In full if that fits; else up to 8 items each summarized if that fits; else a summary."""
    whole = _full_text(node)
    if whole is not None:
        return whole
    if len(node["items"]) <= 8:
        text = _join(node, value_text)
        if len(text) <= WIDTH:
            return text
    return _summary(node["t"], node["items"])


class _TooLong(Exception):
    pass


def _full_text(node: dict[str, Any]) -> str | None:
    """The value with no container summarized, or None if that is longer than :data:`WIDTH`."""
    try:
        return _full(node)
    except _TooLong:
        return None


def _full(node: dict[str, Any]) -> str:
    if node.get("t") not in ("list", "tuple", "dict"):
        return value_text(node)
    if len(node["items"]) > WIDTH // 3:  # too long however short its items: do not build it
        raise _TooLong
    text = _join(node, _full)
    if len(text) > WIDTH:
        raise _TooLong
    return text


def _join(node: dict[str, Any], item_text: Callable[[dict[str, Any]], str]) -> str:
    kind, items = node["t"], node["items"]
    if kind == "dict":
        return "{" + ", ".join(f"{item_text(k)}: {item_text(v)}" for k, v in items) + "}"
    inner = ", ".join(item_text(i) for i in items) + ("," if kind == "tuple" and len(items) == 1 else "")
    return f"[{inner}]" if kind == "list" else f"({inner})"


def _summary(kind: str, items: list[Any]) -> str:
    if kind == "dict":
        return f"<dict of {len(items)} items>"
    plural = _plural(items)
    return f"<{len(items)} {plural}>" if plural != "items" else f"<{kind} of {len(items)} items>"


def _plural(items: list[dict[str, Any]]) -> str:
    """``ints``, ``floats``, ``strs``... when every item is one scalar type, else ``items``."""
    kinds = {type(i.get("v")).__name__ if i.get("t") == "v" else i.get("t") for i in items}
    if len(kinds) == 1:
        (kind,) = kinds
        if kind in ("int", "float", "str", "bool"):
            return f"{kind}s"
    return "items"


def _b64_length(text: str) -> int:
    return len(text) * 3 // 4 - text[-2:].count("=")


def tensor_itemsize(node: dict[str, Any]) -> int | None:
    """Bytes per element of a tensor node; None for a dtype this torch does not know."""
    try:
        return int(dtype_from_name(node.get("dtype")).itemsize)
    except CheckpointError:
        return None


def tensor_nbytes(node: dict[str, Any]) -> int | None:
    """Bytes of the tensor's elements; None for a dtype this torch does not know."""
    itemsize = tensor_itemsize(node)
    if itemsize is None:
        return None
    numel = 1
    for d in node["shape"]:
        numel *= int(d)
    return numel * itemsize


def _tensor_row(key: str, node: dict[str, Any]) -> TensorRow:
    if node.get("t") == "dtensor":  # its global shape and bytes; where: its placements over the mesh
        local = node.get("local") or {}
        shape = tuple(int(d) for d in node.get("shape", ()))
        numel = 1
        for d in shape:
            numel *= d
        itemsize = tensor_itemsize(node)
        placed = f"{local.get('device', '-')} {','.join(map(str, node.get('placements', ())))} mesh {list(node.get('mesh', ()))}"
        return TensorRow(key=key, dtype=str(node.get("dtype")), shape=shape,
                         nbytes=None if itemsize is None else numel * itemsize, device=placed,
                         requires_grad=bool(local.get("requires_grad", False)))
    return TensorRow(
        key=key,
        dtype=str(node.get("dtype")),
        shape=tuple(int(d) for d in node.get("shape", ())),
        nbytes=tensor_nbytes(node),
        device=str(node.get("device")),
        requires_grad=bool(node.get("requires_grad", False)),
    )
