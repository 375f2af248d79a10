"""Writes the results: ``results.json`` (every figure and the environment), ``results.md``
(tables for BENCHMARKS.md, ratios against gpusnap concurrent) and the PNG plots."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from gpusnap.bench.env import CPU_DISCLAIMER
from gpusnap.bench.summary import COMPARATOR, warm_or_first

__all__ = ["markdown", "write_report"]

_CPU_NOTE = "These figures test that the bench runs; they say nothing about gpusnap's performance."
_LEGEND = (
    "Stall: step-time inflation summed over the step containing the save and every step until it is "
    "durable (captured, for saves that are never durable). *vs gpusnap*: that system's stall over gpusnap "
    "concurrent's (above 1x: gpusnap stalls less; below 1x: gpusnap stalls more). Warm: median of the "
    "saves after the first. Loss: throughput lost with a save every N steps; (d) estimated from the warm "
    "stall and write time instead of measured. docs/bench.md defines every column."
)
_SAVE_HEADER = (
    "| system | stall first | stall warm | vs gpusnap | save() call | captured | durable "
    "| capture GB/s (of D2H) | loss N=1 | N=10 | N=100 |"
)
_RESOURCE_HEADER = (
    "| system | extra device mem | pinned host mem | bytes on disk | restore | first step after "
    "| lazy: first step after | lazy: all back | skipped / written (last save) | bit-exact |"
)


def write_report(results: dict[str, Any], out: str, *, plots: bool = True) -> dict[str, str]:
    """Writes every output under ``out``; returns {what: path or "skipped: why"}."""
    os.makedirs(out, exist_ok=True)
    written: dict[str, str] = {}
    if plots:
        from gpusnap.bench.plots import write_plots

        results["plots"] = write_plots(results, out)
    else:
        results["plots"] = {"all": "skipped: --no-plots"}
    md_path = os.path.join(out, "results.md")
    with open(md_path, "w") as f:
        f.write(markdown(results))
    json_path = os.path.join(out, "results.json")
    with open(json_path + ".tmp", "w") as f:
        json.dump(results, f, indent=1, default=str, allow_nan=True)
    os.replace(json_path + ".tmp", json_path)
    written.update(json=json_path, markdown=md_path)
    written.update({f"plot {k}": v for k, v in results["plots"].items()})
    return written


def _ms(v: Any) -> str:
    if not isinstance(v, (int, float)) or math.isnan(v):
        return "-"
    if abs(v) >= 10:
        return f"{v:.1f} s"
    return f"{v * 1e3:.1f} ms" if abs(v) < 1 else f"{v:.2f} s"


def _gb(v: Any) -> str:
    if not isinstance(v, (int, float)):
        return "-"
    return f"{v / 1e9:.2f} GB" if v >= 1e8 else f"{v / 1e6:.1f} MB"


def _ratio(v: Any) -> str:
    return f"{v:.2f}x" if isinstance(v, (int, float)) else "-"


def _loss(row: dict[str, Any], n: int) -> str:
    for t in row.get("throughput") or []:
        if t["every"] == n:
            mark = "" if t["how"] == "measured" else " (d)"
            return f"{t['loss'] * 100:.1f}%{mark}"
    return "-"


def _check(row: dict[str, Any], checks: list[dict[str, Any]]) -> str:
    mine = [c for c in checks if c["system"] == row["key"]]
    if not mine:
        return "-"
    return "exact" if all(c["ok"] for c in mine) else "FAILED"


def _environment(results: dict[str, Any]) -> list[str]:
    env = results["environment"]
    gpu = f"{env['gpu']} (driver {env.get('driver') or '?'})" if env.get("gpu") else "none (CPU)"
    fss = env.get("filesystems", {})
    roots = ", ".join(f"{k} {v['type']}" for k, v in fss.items())
    lines = [
        f"- Command: `{results.get('command') or env.get('command') or 'gpusnap bench'}`",
        (
            f"- Date {env['date']}; GPU: {gpu}; torch {env['torch']} (CUDA {env.get('cuda_runtime') or '-'}); "
            f"Python {env['python']}; gpusnap {env['gpusnap']} ({env.get('gpusnap_commit') or 'no git'}, source {env.get('gpusnap_source') or '?'}); "
            f"transformers {env.get('transformers') or '-'}, torchvision {env.get('torchvision') or '-'}, "
            f"cuda-python {env.get('cuda_python') or '-'}; {env.get('cpu_count')} CPUs."
        ),
        f"- Checkpoint roots: {roots}. Total time {results.get('elapsed_s', 0):.0f} s.",
    ]
    if results.get("omitted"):
        lines.append("- Not measured in this run: " + "; ".join(results["omitted"]) + ".")
    return lines


def markdown(results: dict[str, Any]) -> str:
    lines = ["# gpusnap bench", ""]
    if results.get("disclaimer"):
        lines += [f"> **{CPU_DISCLAIMER}.** {_CPU_NOTE}", ""]
    lines += _environment(results) + [""]
    lines += [_LEGEND, ""]
    for wl in results["workloads"]:
        lines += _workload(wl)
    lines += _behind(results)
    return "\n".join(lines) + "\n"


def _workload(wl: dict[str, Any]) -> list[str]:
    if wl.get("status") != "ok":
        return [f"## {wl['name']}: {wl.get('status')}", ""]
    cfg = ", ".join(f"{k} {v}" for k, v in wl["config"].items())
    d2h = wl["d2h"].get("GBps")
    lines = [
        f"## {wl['name']}: {_gb(wl['state_bytes'])} of state, median step {_ms(wl['median_step_s'])}",
        "",
        f"{wl['impl']}; {cfg}. Device-to-host ceiling (pinned, {_gb(wl['d2h'].get('bytes'))}): "
        + (f"{d2h:.1f} GB/s." if d2h else "not measured (no CUDA)."),
        "",
        _SAVE_HEADER,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    skipped = []
    for row in wl["systems"]:
        if row["status"] != "ok":
            skipped.append(f"- {row['system']}: {row['status']}")
            continue
        bw = row.get("capture_GBps")
        share = row.get("capture_vs_d2h")
        bw_text = "-" if bw is None else f"{bw:.1f}" + (f" ({share * 100:.0f}%)" if share else "")
        durable = _ms(warm_or_first(row, "durable"))
        captured = warm_or_first(row, "captured")
        call = warm_or_first(row, "call")
        lines.append(
            f"| {row['system']} | {_ms(row.get('stall_first_s'))} | {_ms(row.get('stall_warm_s'))} "
            f"| {_ratio(row.get('stall_vs_gpusnap'))} | {_ms(call)} | {_ms(captured)} "
            f"| {durable if row['saves'][0].get('durable_note') is None else 'never'} | {bw_text} "
            f"| {_loss(row, 1)} | {_loss(row, 10)} | {_loss(row, 100)} |"
        )
    lines += [
        "",
        _RESOURCE_HEADER,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in wl["systems"]:
        if row["status"] != "ok":
            continue
        r = row.get("restore") or {}
        lazy_first = None
        if r.get("lazy_return_s") is not None and r.get("lazy_first_step_s") is not None:
            lazy_first = r["lazy_return_s"] + r["lazy_first_step_s"]
        lazy_note = "n/a" if row["family"] != "gpusnap" else ("unavailable" if r and lazy_first is None else "-")
        skipped_written = "-"
        if isinstance(row.get("bytes_skipped"), list) and isinstance(row.get("bytes_written"), list):
            skipped_written = f"{_gb(row['bytes_skipped'][-1])} / {_gb(row['bytes_written'][-1])}"
        lines.append(
            f"| {row['system']} | {_gb(row.get('extra_device_bytes'))} | {_gb(row.get('pinned_bytes'))} "
            f"| {_gb(row.get('bytes_on_disk'))} | {_ms(r.get('eager_s'))} | {_ms(r.get('first_step_s'))} "
            f"| {_ms(lazy_first) if lazy_first is not None else lazy_note} | {_ms(r.get('lazy_total_s'))} "
            f"| {skipped_written} | {_check(row, wl['correctness'])} |"
        )
    lines.append("")
    if skipped:
        lines += ["Not measured:", *skipped, ""]
    for note in wl.get("notes", []):
        lines += [f"Note: {note}", ""]
    failed = [c for c in wl["correctness"] if not c["ok"]]
    lines.append(
        f"Correctness: {len(wl['correctness']) - len(failed)} of {len(wl['correctness'])} checks passed"
        + (": " + "; ".join(f"{c['system']} save {c['save']}: {c['detail']}" for c in failed) if failed else ".")
    )
    lines.append("")
    return lines


def _behind(results: dict[str, Any]) -> list[str]:
    """Every figure where a baseline beats gpusnap concurrent, stated plainly."""
    out = []
    for wl in results["workloads"]:
        if wl.get("status") != "ok":
            continue
        ref = next((r for r in wl["systems"] if r["key"] == COMPARATOR and r["status"] == "ok"), None)
        if ref is None:
            continue
        for row in wl["systems"]:
            if row["family"] != "gpusnap" and row["status"] == "ok":
                out += _compare(wl["name"], ref, row)
    lines = ["## Where gpusnap concurrent is not ahead", ""]
    lines += out or ["- nowhere in this run."]
    return lines + [""] + _caveats(results)


def _caveats(results: dict[str, Any]) -> list[str]:
    """Saves whose stall came out negative: the program's steps ran faster during the window
    than the median measured before any save (its baseline drifted: GPU clocks, caches), so
    those figures say nothing about the save."""
    out = []
    for wl in results["workloads"]:
        for row in wl.get("systems", []):
            bad = [i for i, s in enumerate(row.get("saves") or []) if (s.get("stall_s") or 0.0) < 0]
            if bad:
                out.append(f"- {wl['name']}: {row['system']}: negative stall at save {', '.join(map(str, bad))} "
                           f"(steps ran faster than the workload's median during the window: the baseline "
                           f"drifted; do not read these stalls, or its ratio, as a saving)")
    return ["## Caveats", ""] + out + [""] if out else []


def _compare(workload: str, ref: dict[str, Any], row: dict[str, Any]) -> list[str]:
    out = []
    mine, theirs = warm_or_first(ref, "stall"), warm_or_first(row, "stall")
    if mine is not None and theirs is not None and theirs < mine:
        out.append(f"- {workload}: {row['system']} stalls less ({_ms(theirs)} vs {_ms(mine)} per save).")
    if row["saves"] and row["saves"][0].get("durable_note") is None:
        mine, theirs = warm_or_first(ref, "durable"), warm_or_first(row, "durable")
        if mine is not None and theirs is not None and theirs < mine:
            out.append(f"- {workload}: {row['system']} is durable sooner ({_ms(theirs)} vs {_ms(mine)}).")
    ref_loss = {t["every"]: t for t in ref.get("throughput") or []}
    for t in row.get("throughput") or []:
        r = ref_loss.get(t["every"])
        if r is not None and t["loss"] < r["loss"]:
            how = "" if t["how"] == "measured" else ", derived"
            out.append(f"- {workload}: {row['system']} loses less throughput at a save every {t['every']} "
                       f"steps ({t['loss'] * 100:.1f}% vs {r['loss'] * 100:.1f}%{how}).")
    mine = (ref.get("restore") or {}).get("eager_s")
    theirs = (row.get("restore") or {}).get("eager_s")
    if mine is not None and theirs is not None and theirs < mine:
        out.append(f"- {workload}: {row['system']} restores faster ({_ms(theirs)} vs {_ms(mine)}).")
    return out
