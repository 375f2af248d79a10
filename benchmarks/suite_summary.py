"""Summarize what `benchmarks/gpu_suite.sh` brought back (a suite.tgz or its unpacked folder).

Prints, for whichever steps ran: the test outcome, the tail of each benchmark log, and for
every Chrome trace of a capture window (diag --trace-dir) where its time went: per track the
first and last event and the busy time, the copier's own stops (prepare, finding unchanged
chunks, waiting for copies), and the program's ops and the copies issued per 100 ms.
Run: python3 benchmarks/suite_summary.py /work/.device/N/suite.tgz
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

LOG_TAILS = {"stall.log": 60, "diag.log": 12, "incr.log": 10, "restore.log": 16, "hash.log": 20, "quick.log": 30}


def unpack(source: str) -> Path:
    if os.path.isdir(source):
        return Path(source)
    target = Path(tempfile.mkdtemp(prefix="suite-"))
    with tarfile.open(source) as tar:
        tar.extractall(target, filter="data")
    return target


def tests_outcome(path: Path) -> list[str]:
    lines = path.read_text(errors="replace").splitlines()
    picked = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]  # pytest's short summary
    summary = [ln for ln in lines if " passed" in ln or " failed" in ln]
    return (picked[:40] + summary[-1:]) or lines[-5:]


def trace_summary(path: Path) -> list[str]:
    doc = json.loads(path.read_text())
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and "tid" in e}
    by_track: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for e in events:
        if "ts" in e:
            by_track[names.get(e.get("tid"), str(e.get("tid")))].append(e)
    out = [f"{path.parent.name}/{path.name}"]
    for track, evs in sorted(by_track.items()):
        first = min(e["ts"] for e in evs) / 1e3
        last = max(e["ts"] + e.get("dur", 0) for e in evs) / 1e3
        busy = sum(e.get("dur", 0) for e in evs) / 1e3
        out.append(f"  {track:<8} {len(evs):>6} events  {first:8.1f} -> {last:8.1f} ms  busy {busy:9.1f} ms")
    stops: dict[str, list[float]] = collections.defaultdict(list)
    for e in by_track.get("copier", []):
        stops[e["name"]].append(e.get("dur", 0) / 1e3)
    for name, durs in sorted(stops.items()):
        out.append(f"  copier: {name}: {len(durs)} x, {sum(durs):.1f} ms in all, longest {max(durs):.1f} ms")
    for track in ("program", "copy"):
        evs = by_track.get(track, [])
        if evs:
            buckets = collections.Counter(int(e["ts"] / 100e3) for e in evs)
            out.append(f"  {track} per 100 ms: " + " ".join(str(buckets[i]) for i in range(max(buckets) + 1)))
    return out


def main() -> str | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="suite.tgz, or the folder it was unpacked into")
    ap.add_argument("--traces", type=int, default=2, help="traces shown per variant (the last ones)")
    args = ap.parse_args()
    try:
        root = unpack(args.source)
    except (OSError, tarfile.TarError) as exc:
        return f"suite_summary: cannot read {args.source}: {str(exc).splitlines()[0]}"
    gpu = root / "gpu.txt"
    if gpu.exists():
        print("GPU:", gpu.read_text().strip())
    if (root / "tests.log").exists():
        print("\n== tests")
        print("\n".join(tests_outcome(root / "tests.log")))
    for name, tail in LOG_TAILS.items():
        path = root / name
        if path.exists():
            lines = path.read_text(errors="replace").splitlines()
            starts = [i for i, ln in enumerate(lines) if " GB in " in ln]  # the stall bench's table
            if name == "stall.log" and starts:
                lines, tail = lines[starts[-1] :], len(lines)
            print(f"\n== {name} (last {min(tail, len(lines))} lines)")
            print("\n".join(lines[-tail:]) if lines else "(empty: the step printed nothing)")
    traces = root / "traces"
    if traces.is_dir():
        print("\n== traces")
        for variant in sorted(p for p in traces.iterdir() if p.is_dir()):
            for path in sorted(variant.glob("*.json"))[-args.traces :]:
                print("\n".join(trace_summary(path)))


if __name__ == "__main__":
    sys.exit(main())
