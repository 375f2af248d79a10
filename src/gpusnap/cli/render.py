"""Text renderings for ``ls`` (and the units every command prints). Never decodes pickled values."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (importing the storage package imports torch: ``gpusnap --help`` needs neither)
    from gpusnap.storage.manifest import Manifest

__all__ = ["checkpoint_table", "columns", "format_time", "human_bytes", "manifest_reason", "unreadable_lines"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_time(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def columns(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    """Rows as left-aligned columns two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def checkpoint_table(manifests: list[Manifest], tier: str = "durable") -> list[str]:
    """One row per checkpoint; ``tier`` is the root's (``"fast"``: a fast tier's root)."""
    # (a fast tier's checkpoint is committed there, in host memory: not durable yet)
    ranked = any(m.ranks for m in manifests)  # distributed ones: a RANKS column (their world size)
    rows = [("ID", "TAG", "CREATED", "SIZE", "STALL", "DURABLE" if tier == "durable" else "COMMITTED", "TIER")
            + (("RANKS",) if ranked else ())]
    for m in manifests:
        stats = (m.stats.get("ranks") or [{}])[0] if m.ranks else m.stats  # (rank 0's save)
        stall = stats.get("stall_s")
        duration = stats.get("duration_s")
        rows.append(
            (
                m.id,
                m.tag or "-",
                format_time(m.created),
                human_bytes(m.nbytes),
                f"{stall * 1e3:.1f} ms" if isinstance(stall, (int, float)) else "-",
                f"{duration:.2f} s" if isinstance(duration, (int, float)) else "-",
                tier,
            )
            + ((str(m.world_size),) if ranked else ())
        )
    return columns(rows)


def manifest_reason(where: str, error: str) -> str:
    """``error`` without its leading ``manifest <where>`` (the row already names the file)."""
    head = f"manifest {where} "
    return error[len(head) :] if error.startswith(head) else error


def unreadable_lines(problems: list[tuple[str, str]]) -> list[str]:
    """One ``UNREADABLE <file>: <reason>`` row per manifest that cannot be read."""
    return [f"UNREADABLE  {where}: {manifest_reason(where, error)}" for where, error in problems]
