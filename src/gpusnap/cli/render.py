"""Text renderings of checkpoints for ``ls`` and ``show`` (never decodes pickled values)."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterator
from typing import Any

from gpusnap.storage.manifest import Manifest

__all__ = ["checkpoint_table", "format_time", "human_bytes", "tree_lines"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_time(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def checkpoint_table(manifests: list[Manifest]) -> list[str]:
    rows = [("ID", "TAG", "CREATED", "SIZE", "STALL", "DURABLE")]
    for m in manifests:
        stall = m.stats.get("stall_s")
        duration = m.stats.get("duration_s")
        rows.append(
            (
                m.id,
                m.tag or "-",
                format_time(m.created),
                human_bytes(m.nbytes),
                f"{stall * 1e3:.1f} ms" if isinstance(stall, (int, float)) else "-",
                f"{duration:.2f} s" if isinstance(duration, (int, float)) else "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _key_text(node: dict[str, Any]) -> str:
    kind = node.get("t")
    if kind == "v":
        return str(node.get("v"))
    if kind in ("float", "dtype", "device"):
        return str(node.get("v"))
    return f"<{kind}>"


def _value_text(node: dict[str, Any]) -> str:
    kind = node.get("t")
    if kind == "v":
        text = repr(node.get("v"))
    elif kind == "pickle":
        return "<pickled object: not loaded>"
    elif kind == "bytes":
        text = f"<{len(str(node.get('v', ''))) * 3 // 4} bytes>"
    elif kind == "size":
        text = f"torch.Size({node.get('v')})"
    else:
        text = str(node.get("v"))
    return text if len(text) <= 60 else text[:57] + "..."


def tree_lines(manifest: Manifest) -> Iterator[str]:
    """One line per node: tensors with dtype, shape and bytes; plain values with their value."""
    yield from _walk(manifest.tree, "", manifest)


def _children(node: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    kind = node.get("t")
    if kind == "module":
        return _children(node["entries"])
    if kind == "stateful":
        return _children(node["state"])
    if kind == "dict":
        return [(_key_text(k), v) for k, v in node["items"]]
    if kind in ("list", "tuple"):
        return [(f"[{i}]", v) for i, v in enumerate(node["items"])]
    return []


def _walk(node: dict[str, Any], indent: str, manifest: Manifest) -> Iterator[str]:
    for name, child in _children(node):
        kind = child.get("t")
        if kind == "tensor":
            shape = "x".join(str(d) for d in child["shape"]) or "scalar"
            itemsize = _itemsize(child)
            nbytes = itemsize * _numel(child["shape"]) if itemsize else 0
            yield (
                f"{indent}{name}  {child['dtype']}[{shape}]  {human_bytes(nbytes)}  {child['device']}"
            )
        elif kind in ("module", "stateful", "dict", "list", "tuple"):
            label = {"module": "module", "stateful": child.get("cls", "stateful")}.get(kind, kind)
            yield f"{indent}{name}/  ({label})"
            yield from _walk(child, indent + "  ", manifest)
        else:
            yield f"{indent}{name} = {_value_text(child)}"


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(node: dict[str, Any]) -> int:
    import torch

    dtype = getattr(torch, str(node.get("dtype")), None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 0
