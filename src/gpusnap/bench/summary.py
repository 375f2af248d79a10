"""A row's summary figures: first and warm saves, bandwidth, derived throughput, ratios."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["COMPARATOR", "add_ratios", "brief", "derived_throughput", "jsonable", "summarise", "warm_or_first"]

COMPARATOR = "gpusnap_concurrent"  # the row every ratio is taken against


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(row: dict[str, Any], state_bytes: int, median_s: float, d2h_gbps: float | None) -> None:
    """First-save and warm (median of the others) figures, bandwidth, derived throughput."""
    saves = row["saves"]
    if not saves:
        return
    for key in ("stall_s", "stall_first_step_s", "call_s", "captured_s", "durable_s"):
        row[f"{key[:-2]}_first_s"] = saves[0][key]
        warm = [s[key] for s in saves[1:] if s[key] is not None]
        row[f"{key[:-2]}_warm_s"] = _median(warm)
    row["extra_device_bytes"] = max(s["extra_device_bytes"] for s in saves)
    captured = warm_or_first(row, "captured")
    if captured:
        row["capture_GBps"] = state_bytes / captured / 1e9
        row["capture_vs_d2h"] = row["capture_GBps"] / d2h_gbps if d2h_gbps else None
    stats = [s["stats"] for s in saves]
    for key in ("bytes_skipped", "bytes_written", "bytes_cow", "waits"):
        values = [st.get(key) for st in stats]
        row[key] = values if any(v is not None for v in values) else "not reported"
    if row["status"] == "ok" and not row["throughput"]:
        row["throughput"] = derived_throughput(row, median_s)


def derived_throughput(row: dict[str, Any], median_s: float) -> list[dict[str, Any]]:
    """Loss at a save every N steps, estimated from one save's figures: its stall, or, when a
    save's write (captured to durable) takes longer than N steps, the wait for the writes
    (saves cannot outrun them: at most a bounded number is pending). An estimate from single
    saves; ``every_n`` measures the real one.

    >>> row = {"stall_warm_s": 0.1, "stall_first_s": 1.0, "durable_warm_s": 2.0, "durable_first_s": 3.0,
    ...        "captured_warm_s": 0.5, "captured_first_s": 0.5}
    >>> [round(t["loss"], 3) for t in derived_throughput(row, 0.1)]
    [14.0, 0.5, 0.01]
    """
    stall = warm_or_first(row, "stall")
    durable = warm_or_first(row, "durable")
    captured = warm_or_first(row, "captured")
    write = durable - (captured or 0.0) if durable is not None else 0.0
    out = []
    for n in (1, 10, 100):
        period = n * median_s
        out.append({"every": n, "loss": max(0.0, stall, write - period) / period,
                    "how": "derived: max(warm stall, warm write (captured to durable) - N x median step) "
                           "/ (N x median step)"})
    return out


def warm_or_first(row: dict[str, Any], key: str) -> float | None:
    """A row's warm figure (``KEY_warm_s``), else its first save's."""
    warm = row.get(f"{key}_warm_s")
    return warm if warm is not None else row.get(f"{key}_first_s")


def add_ratios(entry: dict[str, Any]) -> None:
    """Each system's warm stall over gpusnap concurrent's (above 1: gpusnap stalls less)."""
    ref = next((r for r in entry["systems"] if r["key"] == COMPARATOR and r["status"] == "ok"), None)
    ref_stall = None if ref is None else _stall(ref)
    for row in entry["systems"]:
        stall = _stall(row)
        row["stall_vs_gpusnap"] = (
            stall / ref_stall if stall is not None and ref_stall and ref_stall > 0 and row is not ref else None
        )


def _stall(row: dict[str, Any]) -> float | None:
    if row.get("status") != "ok":
        return None
    return warm_or_first(row, "stall")


def brief(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return row["status"]
    parts = []
    for key, label in (("stall_first_s", "stall first"), ("stall_warm_s", "warm"), ("durable_warm_s", "durable")):
        if row.get(key) is not None:
            parts.append(f"{label} {row[key] * 1e3:.1f} ms")
    return ", ".join(parts) or "ok"


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return str(value)
