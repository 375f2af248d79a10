"""A script that ends, or is sent SIGTERM (preemption), with a save or a promotion pending:
the pending work is finished first (SIGTERM: then the process ends with SIGTERM's status,
after any handler the program installed), or what is lost is named on stderr."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpusnap.storage.repository import Repository

PRELUDE = textwrap.dedent(
    """
    import os, signal, sys, time, torch, gpusnap
    durable, fast, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    cfg = gpusnap.Config(chunk_size=64 * 1024, copy_piece_bytes=256 * 1024, fast_slab_bytes=2 << 20)
    state = {"w": torch.arange(2_000_000, dtype=torch.float32), "step": 7}
    """
)

SCRIPT = PRELUDE + textwrap.dedent(
    """
    if mode == "chained":  # the program's own handler, installed before gpusnap's
        def mine(signum, frame):
            open(os.path.join(durable + "-marker"), "w").write("called")
            sys.exit(3)
        signal.signal(signal.SIGTERM, mine)
    ck = gpusnap.Checkpointer(durable, fast_root=None if fast == "-" else fast, config=cfg)
    pending = ck.save(state, promote=fast != "-")
    if mode == "exit":
        sys.exit(0)  # the script ends: pending work finishes at exit
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(120)  # (never reached when the handler ends the process)
    print("not ended", flush=True)
    """
)


def _run(tmp_path: Path, mode: str, fast: bool) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), str(tmp_path / "durable"),
                           str(tmp_path / "fast") if fast else "-", mode],
                          capture_output=True, text=True, timeout=300, check=False)


def _durable_ids(tmp_path: Path) -> list[str]:
    return [m.id for m in Repository.open(tmp_path / "durable").list()]


def test_a_script_that_ends_with_a_promotion_pending_promotes_it(tmp_path: Path) -> None:
    run = _run(tmp_path, "exit", fast=True)
    assert run.returncode == 0, run.stderr
    assert "cannot schedule" not in run.stderr, run.stderr
    assert len(_durable_ids(tmp_path)) == 1, run.stderr


@pytest.mark.parametrize("fast", [False, True], ids=["durable", "promoted"])
def test_sigterm_finishes_the_pending_save_then_ends_by_the_signal(tmp_path: Path, fast: bool) -> None:
    run = _run(tmp_path, "default", fast=fast)
    assert run.returncode == -signal.SIGTERM, (run.returncode, run.stderr)
    assert "not ended" not in run.stdout
    assert len(_durable_ids(tmp_path)) == 1, run.stderr  # committed (and promoted) before the end


def test_sigterm_chains_the_handler_the_program_installed_before(tmp_path: Path) -> None:
    run = _run(tmp_path, "chained", fast=True)
    assert run.returncode == 3, (run.returncode, run.stderr)  # the program's handler ended it
    assert (tmp_path / "durable-marker").read_text() == "called"
    assert len(_durable_ids(tmp_path)) == 1, run.stderr


HANGING = PRELUDE + textwrap.dedent(
    """
    import threading
    from gpusnap.storage import txn
    put = txn.WriteTxn.put_chunk
    def never(self, *a, **k):  # a durable disk that stopped answering
        threading.Event().wait()
    txn.WriteTxn.put_chunk = never
    ck = gpusnap.Checkpointer(durable, config=gpusnap.Config(sigterm_grace_s=1, chunk_size=64 * 1024))
    pending = ck.save(state)
    print(json.dumps({"id": pending.id}), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(120)
    """
)


def test_sigterm_names_a_save_that_cannot_finish_within_the_grace(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text("import json\n" + HANGING)
    run = subprocess.run([sys.executable, str(script), str(tmp_path / "durable"), "-", "x"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == -signal.SIGTERM, (run.returncode, run.stderr)
    pending_id = json.loads(run.stdout.strip().splitlines()[0])["id"]
    assert "SIGTERM" in run.stderr and pending_id in run.stderr, run.stderr
