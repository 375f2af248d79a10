"""benchmarks/fresh_cold_start.py: each run is a new process that restores the saved model and
produces logits equal to the source model's (a smoke test on the CPU, with the tiny model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def test_fresh_processes_restore_and_match(tmp_path: Path) -> None:
    out = tmp_path / "fresh.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fresh_cold_start.py"), "--model", "tiny",
                           "--rounds", "1", "--kinds", "lazy,eager", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["kind"] for r in result["runs"]] == ["lazy", "eager"]
    for run in result["runs"]:
        assert run["match"], run
        marks = run["marks"]
        assert 0 <= marks["imports"] <= marks["cuda_init"] <= marks["restore_returned"] <= marks["first_logits"]


@pytest.mark.parametrize("args", [["--model", "nope"], ["--model", "tiny", "--kinds", "lazy,fast"]])
def test_bad_arguments_are_usage_errors(tmp_path: Path, args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fresh_cold_start.py"), *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path, check=False)
    assert proc.returncode == 2 and ("must be one of" in proc.stderr or "unknown fast" in proc.stderr)
