"""Helpers shared by the capture tests: a tracked CPU window, a gate that holds the copier
with spans still pending, and a runner for cases that crash an interpreter without the fix.

The gate is fault injection at the storage backend: every repository opened while it is in
place writes through a :class:`StoreBackend`, whose chunk stores (pack writes) wait on it.
A save's writers then hold their staging regions, so the copier fills the arena and stalls
with the later spans pending, exactly as behind a slow disk."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from faults import HANG_S, FaultyBackend

import gpusnap
from gpusnap.capture.window import on_program_wait
from gpusnap.storage.backend import Backend, WriteHandle, open_backend
from gpusnap.storage.repository import Repository

CHUNK = 512


def tracked_config(**kw: Any) -> gpusnap.Config:
    """CPU state through a tracked window (no snapshot at save()); one piece fills staging."""
    base: dict[str, Any] = {"chunk_size": CHUNK, "staging_bytes": 4 * CHUNK, "pack_size": 1 << 16,
                            "io_threads": 2, "eager_cpu_bytes": 0, "cpu_snapshot_bytes": 0, "fsync": False}
    base.update(kw)
    return gpusnap.Config(**base)


class StoreBackend(FaultyBackend):
    """A :class:`~faults.FaultyBackend` whose chunk stores (writes to pack files) go through
    ``gate`` (:meth:`StoreGate.store`: held, or failed)."""

    def __init__(self, inner: Backend, gate: StoreGate) -> None:
        super().__init__(inner)
        self.gate = gate
        if hasattr(inner, "local_path"):  # (restores read local files directly, as in production)
            self.local_path = inner.local_path

    def open_write(self, path: str) -> WriteHandle:
        handle = super().open_write(path)
        return _PackHandle(self.gate, handle, self.describe(path)) if path.endswith(".pack") else handle


class _PackHandle:
    def __init__(self, gate: StoreGate, inner: WriteHandle, path: str) -> None:
        self.gate, self.inner, self.path = gate, inner, path

    def write(self, data: bytes | memoryview) -> None:
        self.gate.store(self.path)
        self.inner.write(data)

    def close(self, *, sync: bool) -> None:
        self.inner.close(sync=sync)


def backends_through(monkeypatch: pytest.MonkeyPatch, wrap: Callable[[Backend], Backend]) -> None:
    """Every Repository opened from now on (a Checkpointer's, at its first save) stores
    through ``wrap(its backend)``: Repository.open's ``backend`` argument."""
    real_open = Repository.open.__func__  # type: ignore[attr-defined]

    def open_(cls: Any, root: Any, **kw: Any) -> Any:
        if kw.get("backend") is None:
            kw["backend"] = wrap(open_backend(root, kw.get("storage_options")))
        return real_open(cls, root, **kw)

    monkeypatch.setattr(Repository, "open", classmethod(open_))


class StoreGate:
    """Chunk stores of every repository opened after :meth:`install` (writes to its pack
    files, through a :class:`StoreBackend`) wait while :attr:`open` is clear; :attr:`entered`
    is set as the first one arrives. With :attr:`fail_stores_after` set, that many pack
    writes succeed in all and every later one raises ENOSPC (a disk filling up)."""

    def __init__(self, *, held: bool) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        self.fail_stores_after: int | None = None
        self.pack_writes = 0
        self._lock = threading.Lock()
        if not held:
            self.open.set()

    def release(self) -> None:
        self.open.set()

    def hold(self) -> None:
        self.open.clear()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        backends_through(monkeypatch, lambda inner: StoreBackend(inner, self))

    def store(self, path: str) -> None:
        """A pack write is about to run: hold it, or fail it."""
        self.entered.set()
        if not self.open.wait(HANG_S):
            raise TimeoutError("the store gate was never opened")
        with self._lock:
            self.pack_writes += 1
            full = self.fail_stores_after is not None and self.pack_writes > self.fail_stores_after
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[StoreGate]:
    """Held: chunk stores wait, so the copier fills the staging arena and stalls, every later
    span still pending. A program wait for a span opens it (never a deadlock), and so does
    leaving a Checkpointer's ``with`` block."""
    g = StoreGate(held=True)
    g.install(monkeypatch)
    exit_checkpointer = gpusnap.Checkpointer.__exit__

    def opening_exit(self: Any, *exc_info: Any) -> Any:
        g.release()  # a test that failed before releasing the gate must not stall its save
        return exit_checkpointer(self, *exc_info)

    monkeypatch.setattr(gpusnap.Checkpointer, "__exit__", opening_exit)
    with on_program_wait(g.release):  # the program waits for the copier: let it run
        yield g
    g.release()


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
