"""PNG plots: stall per checkpoint by system (log scale), and one gpusnap window's timeline.

matplotlib is optional: without it every plot is reported as skipped, with the reason.
The timeline draws the bench's own view (program steps, the ``save()`` call, captured and
durable moments); when a save's stats carry a ``trace_path`` (a Chrome-trace JSON from
gpusnap), its events (program ops, chunk copies, copy-on-write) are drawn as extra lanes.
"""

from __future__ import annotations

import json
import os
from typing import Any

from gpusnap.bench.summary import warm_or_first

__all__ = ["write_plots"]

_FLOOR_MS = 0.01  # log scale: stalls at or below 10 us (noise, or none) are drawn at this floor


def write_plots(results: dict[str, Any], out: str) -> dict[str, str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {"all": "skipped: matplotlib is not installed"}
    written = {"stall": _stall_plot(plt, results, os.path.join(out, "stall_by_system.png"))}
    for wl in results["workloads"]:
        if wl.get("status") == "ok":
            path = os.path.join(out, f"timeline_{wl['name']}.png")
            done, note = _timeline_plot(plt, wl, path, results.get("disclaimer"))
            written[f"timeline {wl['name']}"] = done
            if note:
                written[f"timeline {wl['name']} note"] = note
    return written


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def _stall_plot(plt: Any, results: dict[str, Any], path: str) -> str:
    workloads = [w for w in results["workloads"] if w.get("status") == "ok"]
    if not workloads:
        return "skipped: no workload ran"
    height = sum(0.42 * len(w["systems"]) + 1.4 for w in workloads)
    fig, axes = plt.subplots(len(workloads), 1, figsize=(10, height), squeeze=False)
    for ax, wl in zip(axes[:, 0], workloads):
        rows = [r for r in wl["systems"] if r["status"] == "ok" and r.get("stall_first_s") is not None]
        warm = [1e3 * warm_or_first(r, "stall") for r in rows]
        first = [1e3 * r["stall_first_s"] for r in rows]
        y = list(range(len(rows)))
        colors = ["tab:green" if r["family"] == "gpusnap" else "tab:gray" for r in rows]
        ax.barh(y, [max(_FLOOR_MS, v) for v in warm], left=_FLOOR_MS / 2, color=colors, label="warm save (median)")
        ax.scatter([max(_FLOOR_MS, v) for v in first], y, color="black", marker="o", zorder=3, label="first save")
        ax.axvline(wl["median_step_s"] * 1e3, color="tab:blue", linestyle=":", label="one median step")
        ax.set_yticks(y, [r["system"] for r in rows])
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("stall per checkpoint, ms (log scale; at or below 0.01 ms drawn at 0.01)")
        ax.set_title(f"{wl['name']}: {_size(wl['state_bytes'])} of state, median step {wl['median_step_s'] * 1e3:.1f} ms")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    if results.get("disclaimer"):
        fig.suptitle(results["disclaimer"], color="red")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


Lanes = dict[str, tuple[list[tuple[float, float]], list[float]]]  # name -> (spans, instants)


def _trace_lanes(stats: dict[str, Any], offset_s: float) -> tuple[Lanes, str | None]:
    """Lanes of a Chrome trace, one per track (thread name): spans and instants in seconds,
    shifted by ``offset_s`` (trace time 0 is the window's opening, inside ``save()``)."""
    path = stats.get("trace_path")
    if not path:
        return {}, "no trace_path in the save's stats: chunk copies and COW events not drawn"
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        return {}, f"trace {path} unreadable: {exc}"
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    names = {e.get("tid"): str(e.get("args", {}).get("name")) for e in events
             if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "thread_name"}
    lanes: Lanes = {}
    for e in events:
        if not isinstance(e, dict) or e.get("ph") not in ("X", "i", "I") or "ts" not in e:
            continue
        lane = f"trace: {names.get(e.get('tid'), e.get('cat') or e.get('tid'))}"
        spans, instants = lanes.setdefault(lane, ([], []))
        start = e["ts"] / 1e6 + offset_s
        if e["ph"] == "X":
            spans.append((start, e.get("dur", 0) / 1e6))
        else:
            instants.append(start)
    if not lanes:
        return {}, f"trace {path} has no events"
    return lanes, "trace lanes aligned at save()'s return (the window opens inside the call)"


def _timeline_plot(plt: Any, wl: dict[str, Any], path: str, disclaimer: str | None) -> tuple[str, str | None]:
    """(path or "skipped: why", a note on what is missing from the picture)."""
    timeline = wl.get("timeline") or {}
    sample = timeline.get("sample")
    if not sample or not sample.get("timeline"):
        return "skipped: no gpusnap concurrent save with a recorded timeline", timeline.get("note")
    events = sample["timeline"]
    lanes: Lanes = {"program steps": ([], []), "save() call": ([], [])}
    for e in events:
        if e["kind"] == "span":
            lane = "save() call" if e["name"] == "save() call" else "program steps"
            lanes[lane][0].append((e["start"], e["end"] - e["start"]))
    returned = next((e["end"] for e in events if e["name"] == "save() call"), 0.0)
    trace, note = _trace_lanes(sample.get("stats", {}), returned)
    lanes.update(trace)
    note = note or timeline.get("note")
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.5 * len(lanes)))
    for i, (name, (spans, instants)) in enumerate(lanes.items()):
        ax.broken_barh(spans, (i - 0.4, 0.8), facecolors="tab:green" if name == "save() call" else "tab:gray",
                       edgecolor="white", linewidth=0.3)
        if instants:
            ax.vlines(instants, i - 0.4, i + 0.4, color="tab:blue", linewidth=0.3)
    for e in events:
        if e["kind"] == "instant":
            ax.axvline(e["t"], color="tab:red" if e["name"] == "durable" else "tab:orange", linestyle="--")
            ax.text(e["t"], len(lanes) - 0.4, f" {e['name']}", fontsize="small", va="bottom")
    ax.set_yticks(range(len(lanes)), list(lanes))
    ax.invert_yaxis()
    ax.set_xlabel("seconds since save() was called")
    title = f"{wl['name']}: one gpusnap concurrent save (stall {sample['stall_s'] * 1e3:.1f} ms)"
    ax.set_title(title + (f"\n{note}" if note else "") + (f"\n{disclaimer}" if disclaimer else ""), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path, note
