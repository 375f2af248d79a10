"""What the trainer plug-in tests share: a run that must end by SIGKILL, and exact comparison."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

TESTS = Path(__file__).resolve().parent


def run_killed(script: str, *args: str) -> dict[str, Any]:
    """Run ``tests/<script>`` in a fresh interpreter; it must die by SIGKILL after printing
    one JSON line (what it saved), which is returned."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(TESTS / script), *args], capture_output=True, text=True,
                          timeout=280, env=env)
    assert proc.returncode == -signal.SIGKILL, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"the killed run printed no report\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


def assert_equal_tensors(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    """Same keys, every tensor bit for bit (torch.equal)."""
    assert sorted(got) == sorted(want)
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"tensors differ: {differ}"
