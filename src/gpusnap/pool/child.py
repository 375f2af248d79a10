"""The pool's side of one process: started, its messages read on a thread of its own, its
state kept, and stopped and reaped.

States (each change under the pool's condition, which is notified)::

    starting -> ready -> loading -> serving -> ended
        \\-------------------\\----------\\-------> ended   (it failed, or died)

``ended`` is set only once the process has been reaped (``waitpid``): when the pool sees it,
nothing of the process runs any more.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

from gpusnap.pool.messages import describe, recv, send
from gpusnap.pool.worker import BOOT

__all__ = ["Child"]

Output = int | IO[Any] | None


class Child:
    """One pool process. ``on_change(child)`` is called after each message and at the end,
    with the condition held (so the pool's lists change with the state, as one step); it
    returns the events to pass to ``emit``, which is called once the condition is released."""

    def __init__(self, seq: int, start: dict[str, Any], *, env: Mapping[str, str], stdout: Output, stderr: Output,
                 cond: threading.Condition, on_change: Callable[[Child], list[dict[str, Any]]],
                 emit: Callable[[dict[str, Any]], None]) -> None:
        self.seq = seq
        self.cond = cond
        self.state = "starting"
        self.ready: dict[str, Any] = {}
        self.loaded: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None  # {"stage", "type", "message", "traceback"}
        self.value: Any = None
        self.returned = False
        self.returncode: int | None = None
        self.started_at = time.monotonic()
        self.ready_at = 0.0
        self.announced = False  # (the pool has told on_event it is ready)
        self._on_change = on_change
        self._emit = emit
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            # a session of its own: a terminal's Ctrl-C reaches the pool's owner, which stops its processes
            self.proc = subprocess.Popen(
                [sys.executable, "-c", BOOT, start["sys_path_json"], str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=dict(env), stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.pid = self.proc.pid
        self.sock = ours
        message = {k: v for k, v in start.items() if k != "sys_path_json"}
        try:
            send(ours, {**message, "seq": seq})
        except OSError:
            pass  # (it died at once: the reader sees the end)
        self._reader = threading.Thread(target=self._read, name=f"gpusnap-pool-{self.pid}", daemon=True)
        self._reader.start()

    # -- the reader thread ---------------------------------------------------------------------
    def _read(self) -> None:
        exited = _exit_fd(self.pid)  # (a child the entry forked may hold the channel open after it)
        try:
            while True:
                if exited is not None:
                    readable, _, _ = select.select([self.sock, exited], [], [])
                    if self.sock not in readable:
                        break  # exited, and said everything it said
                msg = recv(self.sock)
                if msg is None:
                    break
                with self.cond:
                    self._apply(msg)
                    events = self._on_change(self)
                    self.cond.notify_all()
                self._tell(events)
        finally:
            if exited is not None:
                os.close(exited)
        code = self.proc.wait()  # (its end closed or it exited: reaped now)
        with self.cond:
            self.returncode = code
            self.state = "ended"
            events = self._on_change(self)
            self.cond.notify_all()
        self.sock.close()
        self._tell(events)

    def _tell(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            self._emit(event)

    def _apply(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "ready" and self.state == "starting":
            self.ready = msg
            self.ready_at = time.monotonic()
            self.state = "ready"
        elif op == "loaded" and self.state == "loading":
            if isinstance(msg.get("checkpoint"), str) and isinstance(msg.get("stats"), dict):
                self.loaded = msg
                self.state = "serving"
            else:  # (not what this gpusnap's worker sends: never handed out, take() stops it)
                self.error = {"stage": "load", "message": "it said its weights were in place in a message this pool "
                              f"cannot read ({str(msg)[:120]}): does it run another gpusnap version?"}
        elif op == "failed":
            error = msg.get("error")
            self.error = {"stage": msg.get("stage"), **(error if isinstance(error, dict) else {})}
        elif op == "returned":
            self.value, self.returned = msg.get("value"), True

    # -- the pool's calls (the condition not held unless said) -----------------------------------
    def take(self, checkpoint: str | None, params: Mapping[str, Any]) -> None:
        """Ask for ``checkpoint``'s weights (the state is already ``loading``)."""
        try:
            send(self.sock, {"op": "take", "checkpoint": checkpoint, "params": dict(params)})
        except OSError:
            pass  # (it died: the reader sees the end)

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the process and what it started in its group (its session's own),
        unless it has been reaped (its pid may be another's then)."""
        with self.cond:
            if self.returncode is None:
                try:
                    os.killpg(self.pid, sig)
                except ProcessLookupError:
                    pass

    def end(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; returns once reaped and its reader done."""
        self.send_signal(signal.SIGTERM)
        with self.cond:
            self.cond.wait_for(lambda: self.state == "ended", grace_s)
        if self.state != "ended":
            self.send_signal(signal.SIGKILL)
        self._reader.join()

    def why_ended(self) -> str:
        """How the process ended, in words (its reported error first)."""
        if self.error is not None:
            return describe(self.error)
        code = self.returncode
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            return f"killed by {name}"
        return f"exited with status {code}"


def _exit_fd(pid: int) -> int | None:
    """A descriptor that becomes readable when process ``pid`` exits (Linux 5.3+), or None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
