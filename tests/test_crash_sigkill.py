"""A child process saving in a loop is SIGKILLed at random moments; nothing committed is lost."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import gpusnap
from gpusnap.cli.main import main as cli_main

CHILD = textwrap.dedent(
    """
    import sys, torch, gpusnap
    root = sys.argv[1]
    cfg = gpusnap.Config(chunk_size=64 * 1024, pack_size=512 * 1024, io_threads=2)
    w = torch.zeros(256, 1024)          # 1 MiB, all equal to the step
    noise = torch.zeros(64, 1024)       # changes pseudo-randomly with the step
    app = {"w": w, "noise": noise, "step": 0}
    ck = gpusnap.Checkpointer(root, keep_last=3, config=cfg)
    import torch._dynamo  # what the first concurrent save() imports; keep it out of the kill window
    noise.copy_(torch.randn(64, 1024, generator=torch.Generator().manual_seed(0)))
    ck.save(app, blocking=True)  # step 0: every trial starts with one committed checkpoint
    print("ready", flush=True)
    step = 0
    while True:
        step += 1
        w.fill_(step)
        noise.copy_(torch.randn(64, 1024, generator=torch.Generator().manual_seed(step)))
        app["step"] = step
        ck.save(app, blocking=(step % 2 == 0))
    """
)

TRIALS = int(os.environ.get("GPUSNAP_KILL_TRIALS", "12"))


def _expected(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    noise = torch.randn(64, 1024, generator=torch.Generator().manual_seed(step))
    return torch.full((256, 1024), float(step)), noise


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_nothing(tmp_path: Path) -> None:
    rng = random.Random(1234)
    root = tmp_path / "ck"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    newest_seen = 0
    for trial in range(TRIALS):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(root)], stdout=subprocess.PIPE, env=env
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.05, 1.2))
        proc.send_signal(signal.SIGKILL)
        proc.wait()

        with gpusnap.Checkpointer(root) as ck:
            infos = ck.list()
            assert len(infos) >= 1, f"trial {trial}: the committed checkpoint was lost"
            for info in infos[-2:]:  # the newest (and one older) restore exactly
                app = {"w": torch.empty(256, 1024), "noise": torch.empty(64, 1024), "step": -1}
                ck.restore(app, info.id)
                w, noise = _expected(app["step"])
                assert torch.equal(app["w"], w), (trial, info.id)
                assert torch.equal(app["noise"], noise), (trial, info.id)
            if infos:
                app = {"w": torch.empty(256, 1024), "noise": torch.empty(64, 1024), "step": -1}
                ck.restore(app)
                assert app["step"] >= newest_seen or newest_seen == 0
                newest_seen = 0  # a later child restarts at step 1
        assert cli_main(["verify", str(root)]) == 0, f"verify failed after trial {trial}"
    assert TRIALS > 0
