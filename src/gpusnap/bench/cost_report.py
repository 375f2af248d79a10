"""Writes the cost suite's results: ``cost.json`` (every figure) and ``cost.md`` (per-save
tables per workload, then the short summary table, last)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from gpusnap.bench.cost_summary import BASELINE

__all__ = ["LEGEND", "markdown", "summary_table", "write_cost_report"]

LEGEND = (
    "**cost / ckpt**: wall time of the steps run from save() until the save is durable (at least N steps) "
    "minus as many plain steps, at the mean step of the plain windows just before and after it: what one "
    "checkpoint costs the training job (**plain-step drift**, per save: how far the plain step moved across "
    "it, times its steps). **CPU-s / ckpt**: this process's "
    "CPU-seconds (every thread, user + system) over that window minus the plain steps' over as many steps. "
    "**durable GB/s**: state bytes / (save() to durable). **loss @N**: throughput lost with a save every N "
    "steps, 1 - (steps/s with saves) / (steps/s plain); (d): derived from the warm cost, not measured. "
    "**first ckpt**: the cost of a fresh system's first save. **stall after save()**: save() to the end of "
    "the step containing it, minus one plain step. Figures are warm (median of the saves after the first); "
    "(0.50x) is the ratio to the pinned copy + writer thread row. Each step reads its loss (loss.item()). "
    "The fast tier's saves are durable once committed to the fast tier."
)


def write_cost_report(results: dict[str, Any], out: str) -> dict[str, str]:
    os.makedirs(out, exist_ok=True)
    md_path, json_path = os.path.join(out, "cost.md"), os.path.join(out, "cost.json")
    with open(md_path, "w") as f:
        f.write(markdown(results))
    with open(json_path + ".tmp", "w") as f:
        json.dump(results, f, indent=1, default=str, allow_nan=True)
    os.replace(json_path + ".tmp", json_path)
    return {"json": json_path, "markdown": md_path}


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not math.isnan(v)


def _s(v: Any) -> str:
    if not _num(v):
        return "-"
    if abs(v) >= 10:
        return f"{v:.1f} s"
    return f"{v * 1e3:.1f} ms" if abs(v) < 1 else f"{v:.2f} s"


def _x(v: Any) -> str:
    return f" ({v:.2f}x)" if _num(v) else ""


def _gbps(v: Any) -> str:
    return f"{v:.3g}" if _num(v) else "-"  # (tiny CPU states write at MB/s: keep 3 digits)


def _loss(row: dict[str, Any], n: int) -> str:
    for t in row.get("throughput") or []:
        if t["every"] == n:
            return f"{t['loss'] * 100:.1f}%" + ("" if t["how"] == "measured" else " (d)")
    return "-"


def _checks(entry: dict[str, Any], key: str) -> str:
    mine = [c for c in entry.get("checks", []) if c["system"] == key]
    if not mine:
        return "-"
    return f"exact ({len(mine)})" if all(c["ok"] for c in mine) else "FAILED"


def _head(results: dict[str, Any]) -> list[str]:
    env, opts = results["environment"], results["options"]
    lines = ["# gpusnap bench --cost", ""]
    if results.get("disclaimer"):
        lines += [f"> **{results['disclaimer']}.** These figures test that the suite runs.", ""]
    gpu = env.get("gpu") or "none (CPU)"
    fss = ", ".join(f"{k} {v['type']}" for k, v in env.get("filesystems", {}).items())
    lines += [
        f"- Command: `{results.get('command') or 'gpusnap bench --cost'}`",
        (f"- Date {env['date']}; GPU: {gpu}; torch {env['torch']}; gpusnap {env['gpusnap']} "
         f"({env.get('gpusnap_commit') or 'no git'}, source {env.get('gpusnap_source') or '?'}); "
         f"transformers {env.get('transformers') or '-'}; {env.get('cpu_count')} CPUs; roots: {fss}."),
        (f"- Preset {opts['preset']} (sizes {opts['size']}): N = {opts['window_steps']} steps per window, "
         f"{opts['saves']} saves per row, throughput measured at every {', '.join(map(str, opts['every']))}; "
         f"total {results.get('elapsed_s', 0):.0f} s."),
        "",
        LEGEND,
        "",
    ]
    return lines


def _workload(entry: dict[str, Any]) -> list[str]:
    if entry.get("status") != "ok":
        return [f"## {entry['name']}: {entry.get('status')}", ""]
    cfg = ", ".join(f"{k} {v}" for k, v in entry["config"].items())
    lines = [
        (f"## {entry['name']}: {entry['state_bytes'] / 1e9:.2f} GB of state, step {_s(entry['step_s'])} "
         f"({_s(entry['step_cpu_s'])} CPU)"),
        "",
        f"{entry['impl']}; {cfg}.",
        "",
        "| system | save | steps | window | cost | plain-step drift | CPU-s | save() call | stall after save() | durable | GB/s | tier |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    not_run: list[str] = []
    notes: list[str] = []  # windows that ran out (marked *)
    for row in entry["systems"]:
        if row["status"] != "ok":
            not_run.append(f"- {row['system']}: {row['status']}")
        samples = [(("first" if i == 0 else f"warm {i}"), s) for i, s in enumerate(row["saves"])]
        if row.get("promoted"):
            samples.append(("promote=True", row["promoted"]))
        for what, s in samples:
            tier = s["stats"].get("tier") or "-"
            if s.get("note"):
                notes.append(f"- {row['system']} {what}: {s['note']}")
            lines.append(
                f"| {row['system']} | {what} | {s['steps']}{'*' if s.get('note') else ''} | {_s(s['wall_s'])} | {_s(s['cost_s'])} "
                f"| {_s(s.get('drift_s'))} | {_s(s['cpu_cost_s'])} | {_s(s['call_s'])} | {_s(s['stall_s'])} | {_s(s['durable_s'])} "
                f"| {_gbps(s['durable_GBps'])} | {tier} |"
            )
    lines += [""] + notes
    for row in entry["systems"]:
        lines += _promotion(row)
        for t in row.get("throughput") or []:
            if t.get("cut_by_time"):
                lines.append(f"- {row['system']}: every {t['every']} cut by time after {t['steps']} steps")
        lines += [f"- {row['system']}: {note}" for note in row.get("notes", [])]
    failed = [c for c in entry["checks"] if not c["ok"]]
    lines.append(f"- Bit-exact: {len(entry['checks']) - len(failed)} of {len(entry['checks'])} checks passed"
                 + ("; FAILED: " + "; ".join(f"{c['system']} {c['save']}: {c['detail']}" for c in failed)
                    if failed else "."))
    lines += not_run
    return lines + [""]


def _promotion(row: dict[str, Any]) -> list[str]:
    promoted = row.get("promoted")
    if not promoted:
        return []
    p = promoted.get("promotion") or {}
    when = (f"listed durable {_s(p['after_commit_s'])} after its fast-tier commit" if "after_commit_s" in p
            else p.get("note", "promotion not followed"))
    cpu = row.get("promotion_cpu_s")
    cpu_text = f"promotion CPU {_s(cpu)}" if _num(cpu) else "promotion CPU not reported by this gpusnap (no promotion_cpu_s)"
    return [f"- {row['system']}: the promote=True save was {when}; {cpu_text}"]


def summary_table(results: dict[str, Any]) -> list[str]:
    """The short table: one line per workload and row, warm figures, ratios to the baseline."""
    lines = [
        "## Summary: what a checkpoint costs (warm; ratio to pinned copy + writer thread)",
        "",
        ("| workload | system | cost / ckpt | CPU-s / ckpt | durable GB/s | loss @1 | @10 | @100 | first ckpt "
         "| stall after save() | bit-exact |"),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for entry in results["workloads"]:
        if entry.get("status") != "ok":
            lines.append(f"| {entry['name']} | {entry.get('status')} | | | | | | | | | |")
            continue
        for row in entry["systems"]:
            warm, first = row.get("warm"), row.get("first") or {}
            if warm is None:
                lines.append(f"| {entry['name']} | {row['system']} | {row['status']} | | | | | | | | |")
                continue
            vs = row.get("vs_baseline") or {}
            base = row["key"] == BASELINE
            lines.append(
                f"| {entry['name']} | {row['system']} | {_s(warm['cost_s'])}{'' if base else _x(vs.get('cost'))} "
                f"| {_s(warm['cpu_cost_s'])}{'' if base else _x(vs.get('cpu'))} "
                f"| {_gbps(warm['durable_GBps'])}{'' if base else _x(vs.get('durable_GBps'))} "
                f"| {_loss(row, 1)} | {_loss(row, 10)} | {_loss(row, 100)} | {_s(first.get('cost_s'))} "
                f"| {_s(warm['stall_s'])} | {_checks(entry, row['key'])} |"
            )
    return lines + [""]


def markdown(results: dict[str, Any]) -> str:
    lines = _head(results)
    for entry in results["workloads"]:
        lines += _workload(entry)
    lines += summary_table(results)
    return "\n".join(lines) + "\n"
