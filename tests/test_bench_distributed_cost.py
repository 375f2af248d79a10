"""``benchmarks/distributed_cost.py`` (issue 26's run) end to end on CPU at tiny sizes: two
gloo ranks train an FSDP2 model, save with gpusnap, DCP ``async_save`` and ``dcp.save``, each
first save restores bit-exactly, and the table comes last. (Its CPU figures are no
performance claim; the run it exists for needs two GPUs.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "distributed_cost.py"


def test_the_distributed_cost_run_works_on_cpu(tmp_path: Path) -> None:
    out, root = tmp_path / "out", tmp_path / "root"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--gpus", "1", "--size", "tiny", "--saves", "1",
         "--window", "2", "--timeout", "400", "--out", str(out), "--root", str(root)],
        capture_output=True, text=True, timeout=500, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    table = run.stdout.split("| system |", 1)[1]
    for system in ("gpusnap", "dcp_async", "dcp_save"):
        assert f"| {system} |" in table
    assert "bit-exact: all checks ok" in run.stdout
    for rank in (0, 1):
        doc = json.loads((out / f"rank{rank}.json").read_text())
        assert doc["backend"] == "gloo" and not doc["error"]
        assert set(doc["checks"]) == {f"{s} save 0 bit-exact" for s in ("gpusnap", "dcp_async", "dcp_save")}
        assert all(v == "ok" for v in doc["checks"].values())
        assert all(len(rows) == 1 and rows[0]["steps"] >= 2 for rows in doc["systems"].values())
    assert not root.exists()  # the checkpoints are removed


def test_a_failing_rank_ends_the_run_with_its_error(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--gpus", "1", "--size", "tiny", "--saves", "1",
         "--window", "2", "--timeout", "400", "--out", str(out), "--root", str(tmp_path / "root"),
         "--systems", "gpusnap"],
        capture_output=True, text=True, timeout=500,
        env=dict(os.environ, OMP_NUM_THREADS="1", GPUSNAP_DISTCOST_FAIL_RANK="1"),
    )
    assert run.returncode != 0
    assert "FAIL" in run.stdout and "this rank was told to fail" in run.stdout
    assert "watchdog" not in run.stdout  # ended by the failure, not by the timeout
