"""The restore test suites again, with every restore reading through reader processes.

CI has no GPU, and reader processes are used by default only for restores with CUDA targets:
without this, the lazy, pipelined and corruption suites would never run through them on CPU.
``GPUSNAP_TEST_READER_PROCESSES=on`` (tests/conftest.py) forces them for every restore."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpusnap.restore.pipeline.staging import can_share

ROOT = Path(__file__).resolve().parents[1]
SUITES = ["test_restore_lazy.py", "test_restore_pipelined.py", "test_restore_pieces.py", "test_corruption.py",
          "test_restore_cold.py"]


@pytest.mark.skipif(not can_share(), reason="reader processes need memfd (Linux)")
def test_the_restore_suites_pass_with_every_restore_through_reader_processes(tmp_path: Path) -> None:
    env = {**os.environ, "GPUSNAP_TEST_READER_PROCESSES": "on",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x",
         *[str(ROOT / "tests" / s) for s in SUITES]],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout
