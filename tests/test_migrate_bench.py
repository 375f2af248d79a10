"""benchmarks/migrate_bench.py runs on the CPU with tiny models: a generating model and a
training run each move to a new process, the tokens and the training state afterwards equal
the unmoved run's (a smoke test; the GPU numbers are BENCHMARKS.md's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_benchmark_moves_a_generating_model_and_a_training_run(tmp_path: Path) -> None:
    out = tmp_path / "migrate.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "migrate_bench.py"), "--device", "cpu", "--tiny",
                           "--warm-s", "0", "--tokens", "8", "--steps", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    serving, training = result["serving"], result["training"]
    assert serving["tokens_equal"] and serving["tokens"] == 8
    assert serving["fast"] and training["fast"], (serving["general_why"], training["general_why"])
    assert serving["target_rounds"][-1]["final"] and serving["last_delta_bytes"] < serving["state_bytes"]
    assert training["bit_exact"], training["differing"]
    assert 0 < training["downtime_resume_s"] and 0 < training["stop_the_world_s"]
    assert "serving: downtime" in proc.stdout and "training: bit-exact" in proc.stdout
