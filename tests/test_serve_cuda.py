"""The restore server's CUDA path: copies from its page-locked memory straight into this
process's device memory over CUDA IPC (``restore/via_server/cuda_ipc.py``, ``restore/via_server/request.py``),
and the fallbacks when the server fails after writing there. GPU only (``cuda``)."""

from __future__ import annotations

import signal
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from restore_support import blank_like, states_equal, tiny_config
from serve_support import HANG_S, private_runtime, running_server  # noqa: F401 (a fixture)
from test_restore_cold import TinyLM

import gpusnap
from gpusnap.restore.via_server import client as server_client

pytestmark = pytest.mark.cuda


def _state() -> dict[str, Any]:
    """CUDA spans that go straight to their targets, a transposed CUDA tensor and CPU tensors
    (which land on the host), one allocation holding many small tensors."""
    torch.manual_seed(3)
    state: dict[str, Any] = {f"big{i}": torch.randn(300_000 + 17 * i, device="cuda") for i in range(4)}
    state.update({f"s{i}": torch.randn(7 + i, device="cuda") for i in range(20)})
    state["t"] = torch.randn(40, 30, device="cuda").t()
    state["cpu"] = torch.randn(1000)
    state["half"] = torch.randn(513, device="cuda", dtype=torch.bfloat16)
    state["step"] = 3
    return state


def _save(root: Path, state: dict[str, Any]) -> str:
    with gpusnap.Checkpointer(root, config=tiny_config(chunk_size=1 << 16, staging_bytes=16 << 16)) as ck:
        return ck.save(state, blocking=True).wait().id


def _restore(root: Path, state: dict[str, Any]) -> dict[str, Any]:
    with gpusnap.Checkpointer(root, config=tiny_config(chunk_size=1 << 16, staging_bytes=16 << 16)) as ck:
        return ck.restore(state).stats


def test_cuda_targets_are_written_over_ipc_bit_exact(tmp_path: Path, private_runtime: Path) -> None:
    source = _state()
    _save(tmp_path / "ck", source)
    with running_server(tmp_path / "ck", "--device", "cuda:0"):
        target = blank_like(source)
        versions = {k: v._version for k, v in target.items() if isinstance(v, torch.Tensor)}
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            stats = _restore(tmp_path / "ck", target)
        torch.cuda.synchronize()
        assert states_equal(target, source)
        served = stats["served"]
        assert stats["source"] == "server" and served["handles"] >= 1, served
        assert served["direct_bytes"] >= sum(source[f"big{i}"].numel() * 4 for i in range(4))
        assert served["landed_bytes"] == source["t"].numel() * 4 + source["cpu"].numel() * 4
        assert all(target[k]._version > v for k, v in versions.items()), "the writes count as in-place changes"


def test_cuda_cold_start_is_served(tmp_path: Path, private_runtime: Path) -> None:
    torch.manual_seed(0)
    trained = TinyLM(layers=6).cuda()
    ids = torch.randint(0, 64, (2, 8), device="cuda")
    with torch.no_grad():
        expected = trained(ids)
    _save(tmp_path / "ck", {"model": trained})
    with (running_server(tmp_path / "ck", "--device", "cuda:0"),
          gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config(chunk_size=1 << 16, staging_bytes=16 << 16)) as ck):
        model, handle = gpusnap.cold_start(lambda: TinyLM(layers=6), ck, device="cuda")
        assert handle.done() and handle.stats["source"] == "server"
        assert handle.stats["served"]["direct_bytes"] > 0
        with torch.no_grad():
            assert torch.equal(model(ids), expected)


def _falls_back_after(tmp_path: Path, fault: str, match: str) -> None:
    """With ``fault``, the restore warns ``match``, falls back to files, comes out exact, and
    the server's process was killed (by itself, or by the client before its fallback wrote)."""
    source = _state()
    _save(tmp_path / "ck", source)
    with running_server(tmp_path / "ck", "--device", "cuda:0", env={"GPUSNAP_SERVE_FAULT": fault}) as server:
        target = blank_like(source)
        with pytest.warns(RuntimeWarning, match=match):
            stats = _restore(tmp_path / "ck", target)
        torch.cuda.synchronize()
        assert stats["source"] == "files" and states_equal(target, source)
        assert server.proc.wait(HANG_S) == -signal.SIGKILL


def test_a_server_killed_after_writing_device_memory_is_waited_for_then_rewritten(
        tmp_path: Path, private_runtime: Path) -> None:
    _falls_back_after(tmp_path, "die-after=1300000", "failed before its reply")  # (after some direct copies)


def test_a_stalled_server_that_wrote_device_memory_is_killed_first(
        tmp_path: Path, private_runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_client, "REPLY_TIMEOUT_S", 0.0)  # (it never answers anyway)
    _falls_back_after(tmp_path, "stall-after=1", "sent no reply in time")
