"""Restore-server test support: ``gpusnap serve`` in a subprocess, its JSON events read as
they come, and a private socket directory per test (``XDG_RUNTIME_DIR``).

The server polls only once an hour (``--poll 3600``): tests make it look for new
checkpoints with a ``refresh`` request, never by waiting. Every wait on the server ends only
a hang (``HANG_S``), never a slow machine.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gpusnap.serving import connect

__all__ = ["HANG_S", "ServerProc", "private_runtime", "running_server"]

HANG_S = 240.0
SRC = str(Path(__file__).resolve().parents[1] / "src")


class ServerProc:
    """A running ``gpusnap serve --json``: its process and its events, in order (its stderr
    comes through the same pipe)."""

    def __init__(self, proc: subprocess.Popen[str], root: Path) -> None:
        self.proc = proc
        self.root = root
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            try:
                self.events.put(json.loads(line))
            except ValueError:
                pass
        self.events.put({"event": "eof"})

    def next_event(self, kind: str) -> dict[str, Any]:
        """The next event of ``kind`` (others are skipped); fails on the server's exit."""
        while True:
            try:
                event = self.events.get(timeout=HANG_S)
            except queue.Empty:
                raise AssertionError(f"no {kind!r} event from the server within {HANG_S} s") from None
            if event["event"] == kind:
                return event
            if event["event"] == "eof":
                raise AssertionError(f"the server exited ({self.proc.wait()}) before a {kind!r} event: "
                                     f"{self.stderr()}")

    def ask(self, op: str) -> dict[str, Any]:
        return connect.ask(self.root, op, timeout=HANG_S)

    def stderr(self) -> str:
        """What the server printed that is not an event (stderr goes to the same pipe)."""
        return "".join(line for line in self.lines if not line.startswith("{"))

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(HANG_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def private_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A socket directory of this test's own (servers and clients derive the same one)."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    return run


@contextmanager
def running_server(root: Path, *args: str, env: dict[str, str] | None = None,
                   wait_ready: bool = True) -> Iterator[ServerProc]:
    """``gpusnap serve ROOT --json --poll 3600 ARGS`` (CPU device unless ARGS say otherwise);
    yields once it said ready; stopped (SIGTERM) at the end."""
    full_env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    device = [] if "--device" in args else ["--device", "cpu"]
    proc = subprocess.Popen([sys.executable, "-m", "gpusnap", "serve", str(root), "--json", "--poll", "3600",
                             *device, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env)
    server = ServerProc(proc, root)
    try:
        if wait_ready:
            server.next_event("ready")
        yield server
    finally:
        server.stop()
