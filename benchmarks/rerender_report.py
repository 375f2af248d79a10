"""Re-render a ``gpusnap bench`` report from its ``results.json`` (GPU-free).

Recomputes the figures derived from the measured ones (``summary.derived_throughput``) with
the current code, then rewrites ``results.md`` and ``results.json`` (and the plots unless ``--no-plots``). The
measured figures are not touched. Used when a derivation was corrected after a GPU run, so
the committed report says what the current definitions say (BENCHMARKS.md names each use).
Run: PYTHONPATH=src python3 benchmarks/rerender_report.py DIR [DIR...]
"""

from __future__ import annotations

import argparse
import json
import os

from gpusnap.bench.report import write_report
from gpusnap.bench.summary import derived_throughput


def rerender(folder: str, *, plots: bool) -> None:
    path = os.path.join(folder, "results.json")
    try:
        with open(path) as f:
            results = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"rerender_report: cannot read {path}: {exc}") from None
    if not isinstance(results, dict) or not isinstance(results.get("workloads"), list):
        raise SystemExit(f"rerender_report: {path} is not a gpusnap bench report (no 'workloads' list)")
    for wl in results["workloads"]:
        for row in wl.get("systems", []):
            derived = [t for t in row.get("throughput") or [] if t.get("how") != "measured"]
            if row.get("status") == "ok" and row.get("saves") and derived:
                row["throughput"] = derived_throughput(row, wl["median_step_s"])
    kept = results.get("plots")
    write_report(results, folder, plots=plots)
    if not plots:  # keep the PNGs made with the run, and the report's list of them
        results["plots"] = kept
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=str, allow_nan=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--no-plots", action="store_true", help="keep the run's PNGs (no matplotlib needed)")
    args = ap.parse_args()
    for folder in args.folders:
        rerender(folder, plots=not args.no_plots)
        print(f"re-rendered {folder}")


if __name__ == "__main__":
    main()
