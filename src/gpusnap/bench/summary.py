"""A row's summary figures: first and warm saves, bandwidth, derived throughput, ratios."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["COMPARATOR", "add_ratios", "brief", "jsonable", "summarise"]

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
    captured = row["captured_warm_s"] if row["captured_warm_s"] is not None else row["captured_first_s"]
    if captured:
        row["capture_GBps"] = state_bytes / captured / 1e9
        row["capture_vs_d2h"] = row["capture_GBps"] / d2h_gbps if d2h_gbps else None
    stats = [s["stats"] for s in saves]
    for key in ("bytes_skipped", "bytes_written", "bytes_cow", "waits"):
        values = [st.get(key) for st in stats]
        row[key] = values if any(v is not None for v in values) else "not reported"
    if row["status"] == "ok" and not row["throughput"]:
        stall = row["stall_warm_s"] if row["stall_warm_s"] is not None else row["stall_first_s"]
        row["throughput"] = [
            {"every": n, "loss": max(0.0, stall) / (n * median_s), "how": "derived: warm stall / (N x median step)"}
            for n in (1, 10, 100)
        ]


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
    return row.get("stall_warm_s") if row.get("stall_warm_s") is not None else row.get("stall_first_s")


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
