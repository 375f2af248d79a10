"""``benchmarks/distributed_one_gpu.py`` end to end on CPU at tiny sizes: every variant it
runs passes its own checks, it prints its table, and it removes the roots it made. (Its
figures on CPU are no performance claim.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "distributed_one_gpu.py"


def test_the_one_gpu_script_runs_its_variants_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    tiny = ["--steps", "4", "--every", "2", "--plain-steps", "2", "--size", "0.25", "--width", "32", "--batch", "2",
            "--seq", "4"]
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out), "--variants", "fsdp2", "dtensor",
         "reshard", "kill", "--victims", "1", *tiny],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {r["variant"]: r["result"] for r in json.loads((out / "summary.json").read_text())}
    assert rows == dict.fromkeys(["fsdp2", "dtensor", "reshard-fsdp2", "reshard-dtensor", "kill-rank1"], "ok")
    assert "result / key numbers" in run.stdout and "in save() coordination" in run.stdout
    roots = run.stdout.split("roots ", 1)[1].split(",", 1)[0]
    assert not Path(roots).exists()  # (made under /tmp by the script, and removed)
    kill = json.loads((out / "kill-rank1-0.json").read_text())
    assert kill["checks"]["raised within collective_timeout_s"] == "ok"
