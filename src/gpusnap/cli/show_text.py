"""The text of ``gpusnap show``: a summary by default, every stat with ``--stats``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from gpusnap.cli.render import columns, format_time, human_bytes
from gpusnap.cli.summary import WIDTH, summarize
from gpusnap.storage.manifest import Manifest

__all__ = ["flat_stats", "show_lines"]


def show_lines(m: Manifest, *, all_stats: bool, tier: str = "durable", parts: Sequence[Manifest] = ()) -> Iterator[str]:
    """``parts``: a distributed checkpoint's rank manifests; its tensors and values are rank
    0's (DTensors with their global shapes and placements)."""
    tensors, values = summarize(parts[0] if parts else m)
    yield f"checkpoint {m.id}"
    head = [("tag", m.tag or "-"), ("created", format_time(m.created)), ("tier", tier)]
    if parts:
        head.append(("size", f"{human_bytes(m.nbytes)} over {len(parts)} ranks, chunk size {human_bytes(parts[0].chunk_size)}"))
        head.append(("ranks", ", ".join(f"{r}: {human_bytes(p.nbytes)} in {len(p.storages)} storage(s)"
                                        for r, p in enumerate(parts))))
        head.append(("shown", "rank 0's part (DTensors: global shapes)"))
        m = parts[0]  # its stats: rank 0's save
    else:
        size = f"{human_bytes(m.nbytes)} in {len(m.storages)} storage(s), chunk size {human_bytes(m.chunk_size)}"
        head.append(("size", size))
    if not all_stats:
        head += _key_stats(m.stats)
    yield from columns(head, "  ")
    if all_stats:
        yield ""
        yield f"stats ({len(m.stats)}):"
        yield from columns([(k, v) for k, v in flat_stats(m.stats)] or [("-", "")], "  ")
    yield ""
    known = sum(t.nbytes or 0 for t in tensors)
    yield f"tensors ({len(tensors)}, {human_bytes(known)}):" if tensors else "tensors: none"
    if tensors:
        rows = [("KEY", "DTYPE", "SHAPE", "BYTES", "DEVICE")]
        for t in tensors:
            shape = "x".join(map(str, t.shape)) or "scalar"
            size = "?" if t.nbytes is None else human_bytes(t.nbytes)
            rows.append((t.key, t.dtype, shape, size, t.device))
        yield from columns(rows, "  ")
    yield ""
    yield f"values ({len(values)}):" if values else "values: none"
    for v in values:
        yield f"  {v.key} = {v.text}"
    if not all_stats:
        yield ""
        count = sum(1 for _ in flat_stats(m.stats))
        yield f"(--stats: all {count} stats of the save; --json: everything, machine readable)"


def _key_stats(stats: dict[str, Any]) -> list[tuple[str, str]]:
    """The few stats a reader wants first; absent ones are left out."""
    out: list[tuple[str, str]] = []
    stall, duration = stats.get("stall_s"), stats.get("duration_s")
    if _number(stall):
        out.append(("stall", f"{stall * 1e3:.1f} ms (the program waited this long in save())"))
    if _number(duration):
        out.append(("durable", f"{duration:.3g} s after save()"))
    written, total = stats.get("bytes_written"), stats.get("bytes_total")
    if _number(written):
        text = human_bytes(written)
        if _number(total) and total > written:
            text += f" of {human_bytes(total)} ({human_bytes(total - written)} were already stored)"
        out.append(("written", text))
    for key in ("incremental", "validation"):
        if isinstance(stats.get(key), str):
            out.append((key, _clip(stats[key], 2 * WIDTH)))
    return out


def flat_stats(stats: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """``(dotted key, text)`` for every stat, sorted; nested dicts flattened, long lists summarized."""
    for key in sorted(stats, key=str):
        value = stats[key]
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from flat_stats(value, f"{name}.")
        else:
            yield name, _stat_text(value)


def _stat_text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        text = repr(list(value))
        return text if len(text) <= WIDTH else f"<{len(value)} items>"
    return _clip(repr(value) if not isinstance(value, str) else value, 2 * WIDTH)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
