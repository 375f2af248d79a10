"""benchmarks/cold_start_serve.py: fresh processes load a tiny Llama through the restore
server and a baseline, with logits equal to the source model's, and leave nothing on /dev/shm
(a smoke test on the CPU; the GPU run measures)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "cold_start_serve.py"


def _shm_dirs() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("gpusnap-cold-serve-")} if os.path.isdir("/dev/shm") else set()


def test_fresh_processes_load_through_the_server_and_match(tmp_path: Path) -> None:
    before = _shm_dirs()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--small", "--rounds", "1", "--kinds", "torch_load,server-warm",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=900, env=env,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["kind"] for r in result["runs"]] == ["torch_load", "server-warm"]
    assert all(r["equal"] for r in result["runs"])
    assert result["runs"][1]["stats"]["source"] == "server"
    assert result["runs"][1]["stats"]["warm_up"] in ("running", "ok")  # (it may end after the first logits)
    assert "kind | round | first logits s" in proc.stdout.splitlines()[-4]
    assert (tmp_path / "out" / "server.log").exists() and (tmp_path / "out" / "round0-server-warm.log").exists()
    assert _shm_dirs() == before, "the run's /dev/shm files are removed"


def test_unknown_kinds_are_usage_errors(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--kinds", "server,fast"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "unknown fast" in proc.stderr
