"""A Checkpointer the program drops right after ``save()`` (keeping only the PendingSave, or
nothing): the save, or the promotion it queued, is still finished at interpreter exit and on
SIGTERM. Pending work keeps the save path alive, and the exit hooks track the save path."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpusnap.storage.repository import Repository

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time, torch, gpusnap
    durable, mode = sys.argv[1], sys.argv[2]
    cfg = gpusnap.Config(chunk_size=64 * 1024, copy_piece_bytes=256 * 1024, fast_slab_bytes=2 << 20,
                         sigterm_grace_s=60, warm_up_kernels=False)
    state = {"w": torch.arange(8_000_000, dtype=torch.float32), "step": 7}
    if mode.startswith("promote"):
        ck = gpusnap.Checkpointer(durable, fast_root=durable + "-fast", config=cfg)
        pending = ck.save(state, promote=True)
        pending.wait()  # committed to the fast tier; its promotion to `durable` is queued
    else:
        ck = gpusnap.Checkpointer(durable, config=cfg)
        pending = ck.save(state)
    del ck  # the program keeps only the handle (or, with 'drop', nothing)
    if mode.startswith("drop"):
        del pending
    if mode.endswith("exit"):
        sys.exit(0)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(120)  # (the handler ends the process first)
    """
)


@pytest.mark.parametrize("mode", ["keep-exit", "drop-exit", "keep-term", "promote-exit"])
def test_the_save_of_a_dropped_checkpointer_is_finished(tmp_path: Path, mode: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    durable = tmp_path / "durable"
    run = subprocess.run([sys.executable, str(script), str(durable), mode],
                         capture_output=True, text=True, timeout=300, check=False)
    ids = [m.id for m in Repository.open(durable).list()] if durable.exists() else []
    assert len(ids) == 1, (run.returncode, run.stderr[-2000:])
