"""Helpers shared by the capture tests: a tracked CPU window, a gate that holds the copier
with spans still pending, and a runner for cases that crash an interpreter without the fix."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from faults import HANG_S

import gpusnap
from gpusnap.capture import concurrent as _concurrent
from gpusnap.capture.window import CaptureWindow

CHUNK = 512


def tracked_config(**kw: Any) -> gpusnap.Config:
    """CPU state through a tracked window (no snapshot at save()); one piece fills staging."""
    base: dict[str, Any] = {"chunk_size": CHUNK, "staging_bytes": 4 * CHUNK, "pack_size": 1 << 16,
                            "io_threads": 2, "eager_cpu_bytes": 0, "cpu_snapshot_bytes": 0, "fsync": False}
    base.update(kw)
    return gpusnap.Config(**base)


class Gate:
    """While held, chunk stores wait: the copier fills the staging arena and stalls, every
    later span still pending. A program wait for a span opens it (never a deadlock), and so
    does leaving a Checkpointer's ``with`` block."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def release(self) -> None:
        self.open.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate()
    store = _concurrent.ConcurrentSave._store
    wait_captured = CaptureWindow._wait_captured

    def gated_store(self: Any, *args: Any, **kwargs: Any) -> Any:
        g.open.wait(HANG_S)
        return store(self, *args, **kwargs)

    def opening_wait(self: Any, ws: Any) -> Any:
        g.open.set()
        return wait_captured(self, ws)

    exit_checkpointer = gpusnap.Checkpointer.__exit__

    def opening_exit(self: Any, *exc_info: Any) -> Any:
        g.open.set()  # a test that failed before releasing the gate must not stall its save
        return exit_checkpointer(self, *exc_info)

    monkeypatch.setattr(_concurrent.ConcurrentSave, "_store", gated_store)
    monkeypatch.setattr(CaptureWindow, "_wait_captured", opening_wait)
    monkeypatch.setattr(gpusnap.Checkpointer, "__exit__", opening_exit)
    yield g
    g.open.set()


def restored(ck: gpusnap.Checkpointer, like: dict[str, torch.Tensor], checkpoint: str) -> dict[str, torch.Tensor]:
    fresh = {k: torch.full_like(v, 7) for k, v in like.items()}
    ck.restore(fresh, checkpoint)
    return fresh


def assert_bits(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for k, v in expected.items():
        assert torch.equal(got[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)), f"{k} differs"


def run_isolated(script: str, *args: str, timeout: float = 300) -> str:
    """Run ``script`` in a fresh interpreter (a crash there must not end the suite); its
    stdout, once it printed OK and exited 0."""
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    detail = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, detail
    assert "OK" in proc.stdout, detail
    return proc.stdout
