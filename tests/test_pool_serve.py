"""The pool with the restore server (CPU): ``gpusnap serve ROOT --pool N --entry`` serves its
processes' weights from the server's memory and hands one out on a ``take`` request; a
server that dies mid-transfer leaves the pool process's model complete (from the files),
never half-written."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from pool_support import reference_logits, trained
from restore_support import tiny_config
from serve_support import HANG_S, SRC, private_runtime, running_server  # noqa: F401 (a fixture)
from test_pool import IDS, gone

import gpusnap
from gpusnap.pool import Pool, take_from
from gpusnap.restore.pipeline.staging import can_share

pytestmark = pytest.mark.skipif(not can_share(), reason="the restore server needs memfd (Linux)")

TESTS = str(Path(__file__).resolve().parent)


def _save(root: Path, model: torch.nn.Module) -> str:
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        return ck.save({"model": model}, blocking=True).wait().id


def _logits(model: torch.nn.Module) -> torch.Tensor:
    return reference_logits(model, IDS)


def test_gpusnap_serve_keeps_a_pool_and_hands_out_served_processes(tmp_path: Path, private_runtime: Path) -> None:
    model = trained(4)
    cid = _save(tmp_path / "ck", model)
    env = {"PYTHONPATH": os.pathsep.join([SRC, TESTS])}  # (the processes import pool_support)
    with running_server(tmp_path / "ck", "--pool", "2", "--entry", "pool_support:serve", env=env) as server:
        out = tmp_path / "out.json"
        handed = take_from(tmp_path / "ck", params={"ids": IDS, "out": str(out)}, timeout=HANG_S)
        assert handed.checkpoint == cid
        assert handed.stats["source"] == "server" and handed.stats["served"]["bytes"] > 0
        assert server.next_event("pool-exited")["pid"] == handed.pid  # (the entry wrote its answer, then returned)
        answer = json.loads(out.read_text())
        assert torch.equal(torch.tensor(answer["logits"]), _logits(model)) and answer["source"] == "server"
        assert os.stat(out).st_mode & 0o777 == 0o600
        with pytest.raises(gpusnap.CheckpointNotFoundError, match="nope"):
            take_from(tmp_path / "ck", "nope", timeout=HANG_S)
        assert server.stop() == 0
    started = [e["pid"] for e in _events(server.lines) if e["event"] == "pool-started"]
    assert len(started) >= 3 and all(gone(pid) for pid in started), "the server's pool processes end with it"
    with pytest.raises(OSError):
        take_from(tmp_path / "ck", timeout=HANG_S)


def test_a_server_killed_mid_transfer_leaves_the_pool_process_complete(tmp_path: Path,
                                                                        private_runtime: Path) -> None:
    model = trained(5)
    _save(tmp_path / "ck", model)
    with running_server(tmp_path / "ck", env={"GPUSNAP_SERVE_FAULT": "die-after=4096"}) as server, \
            Pool(tmp_path / "ck", "pool_support:serve", config=tiny_config()) as pool:
        with pytest.raises(gpusnap.pool.PoolError, match="runs no pool"):
            take_from(tmp_path / "ck", timeout=HANG_S)  # (a plain gpusnap serve)
        proc = pool.take(params={"ids": IDS}, timeout=HANG_S)
        assert server.proc.wait(HANG_S) == -signal.SIGKILL
        stats: dict[str, Any] = dict(proc.stats)
        assert stats["source"] == "files" and "failed before its reply" in stats["server_fallback"]
        done = proc.wait(HANG_S)
    assert done.returncode == 0 and torch.equal(torch.tensor(done.value["logits"]), _logits(model))


def _events(lines: list[str]) -> list[dict[str, Any]]:
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except ValueError:  # (what the processes printed: it shares the server's pipe)
            pass
    return found


@pytest.mark.cuda
def test_a_cuda_pool_process_gets_its_weights_over_ipc_into_the_tensors_it_built(tmp_path: Path,
                                                                                  private_runtime: Path) -> None:
    model = trained(6).cuda()
    _save(tmp_path / "ck", model)
    with torch.no_grad():
        expected = model(torch.tensor(IDS, device="cuda")).cpu()
    with running_server(tmp_path / "ck", "--device", "cuda:0"), \
            Pool(tmp_path / "ck", "pool_support:serve", device="cuda:0", config=tiny_config()) as pool:
        proc = pool.take(params={"ids": IDS}, timeout=HANG_S)
        served = proc.stats["served"]
        assert proc.stats["source"] == "server" and proc.device == "cuda:0"
        assert served["direct_bytes"] == served["bytes"] > 0 and served["handles"] >= 1  # (nothing landed on the host)
        done = proc.wait(HANG_S)
    assert done.returncode == 0 and torch.equal(torch.tensor(done.value["logits"]), expected)
