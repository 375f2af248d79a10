"""A cost row's headline figures (first save, warm saves) and its ratios to the baseline row.

*First*: the first save of a fresh system (a new Checkpointer: its pools allocated, its first
plan made). *Warm*: the median over the saves after it. Ratios divide a row's warm figure by
the baseline's (``pinned_writer``: pinned copy + writer thread), so below 1x costs less
than the baseline, and for bandwidth above 1x is faster.
"""

from __future__ import annotations

import statistics
from typing import Any

from gpusnap.bench.cost import Window
from gpusnap.bench.cost_throughput import derived

__all__ = ["BASELINE", "add_ratios", "summarise"]

BASELINE = "pinned_writer"
_FIGURES = ("cost_s", "cpu_cost_s", "durable_s", "durable_GBps", "stall_s", "call_s")


def _median(values: list[Any]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


def summarise(row: dict[str, Any], every: list[int]) -> None:
    """Fills ``row["first"]``, ``row["warm"]``, promotion CPU and the derived throughput."""
    saves = row.get("saves") or []
    if not saves:
        return
    row["first"] = {k: saves[0].get(k) for k in _FIGURES}
    warm = saves[1:] or saves[:1]  # one save only: its figures stand for both (said in the notes)
    row["warm"] = {k: _median([s.get(k) for s in warm]) for k in _FIGURES}
    if len(saves) == 1:
        row["notes"].append("one save only: the warm figures are the first save's")
    promoted = row.get("promoted") or {"stats": {}}
    promotions = [s["stats"].get("promotion_cpu_s") for s in saves + [promoted]]
    promotions.append((promoted.get("promotion") or {}).get("promotion_cpu_s"))
    row["promotion_cpu_s"] = _median(promotions)  # None: this gpusnap reports none
    plain = row.get("plain")
    if plain is None:
        return
    window = Window(plain["steps"], plain["wall_s"], plain["cpu_s"])
    measured = {t["every"] for t in row["throughput"]}
    for n in every:
        if n not in measured:
            estimate = derived(n, row["warm"]["cost_s"], row["warm"]["durable_s"], window)
            if estimate is not None:
                row["throughput"].append(estimate)
    row["throughput"].sort(key=lambda t: t["every"])


def _ratio(mine: Any, theirs: Any) -> float | None:
    if not isinstance(mine, (int, float)) or not isinstance(theirs, (int, float)) or theirs <= 0:
        return None
    return mine / theirs  # type: ignore[no-any-return]


def add_ratios(entry: dict[str, Any]) -> None:
    """Each row's warm cost, CPU and bandwidth over the baseline row's (None without one)."""
    base = next((r for r in entry["systems"] if r["key"] == BASELINE and r.get("warm")), None)
    for row in entry["systems"]:
        warm = row.get("warm")
        if base is None or warm is None:
            row["vs_baseline"] = None
            continue
        row["vs_baseline"] = {
            "cost": _ratio(warm["cost_s"], base["warm"]["cost_s"]),
            "cpu": _ratio(warm["cpu_cost_s"], base["warm"]["cpu_cost_s"]),
            "durable_GBps": _ratio(warm["durable_GBps"], base["warm"]["durable_GBps"]),
        }
