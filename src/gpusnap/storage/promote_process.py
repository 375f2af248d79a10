"""Promotions in a helper process: the writes and device checks leave the program's interpreter.

Why: a promotion run on the program's threads (``storage/promote.py``) costs the training
thread the interpreter lock at each of its hundreds of checks and writes: on an H100 the
steps while it checked cost 4.5-7.1 ms more each, the training thread blocking some 30 times
a step (BENCHMARKS.md, seventh section). The helper runs the same :func:`promote` with its own
interpreter, threads and CUDA context; the program's promoter thread sends it a job and sleeps
in a pipe read until the answer.

Data flow::

    promoter thread:  job (tier, checkpoint id, durable root) -> helper
    helper:           open the fast tier (the same slab files; the program keeps the
                      checkpoint pinned) and the durable root (as the program's writer: the
                      program holds the root's writer lease throughout) -> write, check
                      -> "commit?"
    promoter thread:  under the promotion's CancelToken: "go" (or "no": called off)
    helper:           commit -> "done" (or "error": type, message), its CPU seconds so far

A cancel while the helper works is forwarded at once (it stops before its next run or check);
the commit waits for the program's "go", so :meth:`CancelToken.cancel` and the commit still
exclude each other, and a program that died never gets a commit (end of input: called off).

Protocol: 8-byte little-endian length, then a ``marshal`` body, over the helper's stdin and
stdout (nothing else reaches them: its own output goes to stderr). Only local roots are
promoted here; the program's threads do the rest (:func:`process_usable`).

>>> helper = PromotionProcess(Config())                        # doctest: +SKIP
>>> helper.promote(tier, manifest, durable, cancel=CancelToken(), workers=4)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import marshal
import os
import struct
import subprocess
import sys
import threading
import weakref
from typing import Any

import gpusnap
from gpusnap.config import Config
from gpusnap.errors import CheckpointError, CheckpointNotFoundError, IntegrityError, StorageError
from gpusnap.fork_safety import at_fork
from gpusnap.storage.backend import LocalBackend
from gpusnap.storage.fast_tier import FastTier
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.promote import CancelToken, PromotionCancelled
from gpusnap.storage.repository import Repository

__all__ = ["HelperUnavailable", "PromotionProcess", "process_usable", "read_message", "write_message"]

LEN = struct.Struct("<Q")
# a helper not ready by then never will be (importing torch and starting CUDA: seconds)
START_TIMEOUT_S = 120.0
CLOSE_TIMEOUT_S = 10.0  # close(): then a helper still there is killed
_ERRORS: dict[str, type[CheckpointError]] = {e.__name__: e for e in (
    CheckpointError, IntegrityError, StorageError, CheckpointNotFoundError, PromotionCancelled)}


class HelperUnavailable(CheckpointError):
    """The helper could not start, or ended without an answer: the promotion was not committed
    by it, and the program's threads take promotions over."""


def process_usable(config: Config, fast: FastTier, durable: Repository, devices: list[str]) -> bool:
    """Whether ``config`` asks for the helper for this promotion: local roots (both), and for
    ``auto`` a checkpoint with CUDA tensors (the interpreter lock is what it saves them)."""
    mode = config.promotion_process
    if mode == "off" or type(durable) is not Repository or not isinstance(durable.backend, LocalBackend) \
            or not isinstance(fast.backend, LocalBackend):
        return False
    return mode == "on" or any(d.startswith("cuda") for d in devices)


def write_message(fd: int, obj: Any) -> None:
    body = marshal.dumps(obj)
    view = memoryview(LEN.pack(len(body)) + body)
    while view:
        view = view[os.write(fd, view):]


def read_message(fd: int) -> Any:
    """The next message on ``fd``; EOFError at its end (the other side is gone)."""
    (n,) = LEN.unpack(_read_exactly(fd, LEN.size))
    return marshal.loads(_read_exactly(fd, n))


def _read_exactly(fd: int, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = os.read(fd, n - got)  # (blocks without the interpreter lock)
        if not part:
            raise EOFError
        parts.append(part)
        got += len(part)
    return b"".join(parts)


class PromotionProcess:
    """One helper process, started at the first :meth:`promote` and kept until :meth:`close`;
    one promotion at a time. ``cpu_s``: the helper's CPU seconds (all its threads) so far."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # one promotion at a time
        self._send_lock = threading.Lock()  # (a cancel is sent from the canceller's thread)
        self._closed = False
        self.cpu_s = 0.0
        _helpers.add(self)

    # -- the helper's life ---------------------------------------------------------------
    def _started(self, device: str | None) -> subprocess.Popen[bytes]:
        if self._closed:
            raise HelperUnavailable("the promotion helper is closed")
        if self._proc is not None:
            if self._proc.poll() is not None:
                raise HelperUnavailable(f"the promotion helper ended (exit code {self._proc.returncode})")
            return self._proc
        env = dict(os.environ)
        # the gpusnap this program runs, whatever put it on sys.path
        here = os.path.dirname(os.path.dirname(os.path.abspath(gpusnap.__file__)))
        env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        safe_path = ["-P"] if sys.version_info >= (3, 11) else []  # (no module of the working directory)
        argv = [sys.executable, *safe_path, "-c", "from gpusnap.storage.promote_worker import main; main()"]
        try:
            # its own session: a Ctrl-C at the terminal is the program's to handle, not the
            # helper's (it ends when the program's end of the pipe closes)
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True,
                                    start_new_session=True, bufsize=0)
        except OSError as exc:
            raise HelperUnavailable(f"the promotion helper could not start: {exc}") from exc
        self._proc = proc
        try:
            self._send(("hello", dataclasses.asdict(self._config), device))
            ready = self._receive(START_TIMEOUT_S)
        except HelperUnavailable:
            self._kill()
            raise
        if not (isinstance(ready, tuple) and ready and ready[0] == "ready"):
            self._kill()
            raise HelperUnavailable(f"the promotion helper did not start: {ready!r:.300}")
        return proc

    def close(self) -> None:
        """End the helper (end of its input; killed if still there after ``CLOSE_TIMEOUT_S``)."""
        with self._lock:
            self._closed = True
            proc, self._proc = self._proc, None
        if proc is None:
            return
        for pipe in (proc.stdin, proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()

    # -- messages --------------------------------------------------------------------------
    def _send(self, message: Any) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None:
            raise HelperUnavailable("the promotion helper is gone")
        try:
            with self._send_lock:
                write_message(proc.stdin.fileno(), message)
        except (OSError, ValueError) as exc:
            raise HelperUnavailable(f"the promotion helper is gone (exit code {proc.poll()})") from exc

    def _receive(self, timeout: float | None = None) -> Any:
        proc = self._proc
        if proc is None or proc.stdout is None:
            raise HelperUnavailable("the promotion helper is gone")
        fd = proc.stdout.fileno()
        if timeout is not None:
            import select  # (only the start waits with a bound: a promotion takes what the disk takes)

            if not select.select([fd], [], [], timeout)[0]:
                raise HelperUnavailable(f"the promotion helper did not answer within {timeout:.0f} s")
        try:
            message = read_message(fd)
        except (OSError, EOFError, ValueError) as exc:
            code = proc.wait(timeout=CLOSE_TIMEOUT_S) if proc.poll() is None and isinstance(exc, EOFError) else proc.poll()
            raise HelperUnavailable(f"the promotion helper ended without an answer (exit code {code})") from exc
        return message

    # -- a promotion -------------------------------------------------------------------------
    def promote(self, fast: FastTier, manifest: Manifest, durable: Repository, *,
                extra_stats: dict[str, object] | None = None, cancel: CancelToken, workers: int) -> Manifest:
        """:func:`~gpusnap.storage.promote.promote` in the helper; returns the durable manifest.
        Raises what the helper's promotion raised (IntegrityError, StorageError,
        PromotionCancelled, ...), or :class:`HelperUnavailable` when the helper could not
        start or ended first (then nothing was committed by it)."""
        device = next((e.device for e in manifest.storages if e.device.startswith("cuda")), None)
        with self._lock:
            self._started(device)
            fast.pin_checkpoint(manifest.id)  # (the helper reads its slab bytes: retention keeps them)
            stop_forwarding = lambda: None  # noqa: E731
            try:
                job = {"fast_root": fast.backend.local_path(""), "fast_identity": fast.identity,
                       "durable_root": durable.backend.local_path(""), "id": manifest.id, "workers": workers,
                       "extra_stats": dict(extra_stats or {})}
                self._send(("job", job))
                stop_forwarding = cancel.when_cancelled(lambda: self._forward_cancel())
                reply = self._receive()
                if isinstance(reply, tuple) and reply and reply[0] == "commit?":
                    reply = self._gate(cancel, manifest.id, durable)
                return self._result(reply, manifest.id, durable)
            finally:
                stop_forwarding()
                fast.unpin_checkpoint(manifest.id)

    def _forward_cancel(self) -> None:
        try:
            self._send(("cancel",))
        except HelperUnavailable:
            pass  # (gone: it commits nothing without our "go")

    def _gate(self, cancel: CancelToken, checkpoint_id: str, durable: Repository) -> Any:
        """The helper asks to commit: "go" under the token (a cancel() waits for the answer
        that follows), else "no"; returns the helper's last answer."""
        try:
            with cancel.committing(checkpoint_id):
                self._send(("go",))
                try:
                    return self._receive()
                except HelperUnavailable as gone:
                    # it ended after our "go": committed or not, the root says which
                    try:
                        durable.load_manifest(checkpoint_id)
                    except CheckpointNotFoundError:
                        raise gone from None
                    return ("done", None)
        except PromotionCancelled:
            self._send(("no",))
            return self._receive()

    def _result(self, reply: Any, checkpoint_id: str, durable: Repository) -> Manifest:
        if isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "done":
            if isinstance(reply[1], (int, float)):
                self.cpu_s = float(reply[1])
            return durable.load_manifest(checkpoint_id)
        if isinstance(reply, tuple) and len(reply) == 4 and reply[0] == "error":
            _, kind, text, cpu = reply
            if isinstance(cpu, (int, float)):
                self.cpu_s = float(cpu)
            error = _ERRORS.get(kind)
            raise error(text) if error is not None else CheckpointError(f"the promotion helper failed: {kind}: {text}")
        self._kill()
        raise HelperUnavailable(f"the promotion helper answered {reply!r:.200}")



def cpu_seconds() -> float:
    """This process's CPU seconds, all threads (what a helper reports)."""
    t = os.times()
    return t.user + t.system


_helpers: weakref.WeakSet[PromotionProcess] = weakref.WeakSet()


def _after_fork() -> None:
    """A forked child (a DataLoader worker) has no promoter thread: it lets go of the parent's
    helpers without a word to them (their pipes are the parent's to close)."""
    for helper in list(_helpers):
        helper._proc, helper._closed = None, True


at_fork(after_in_child=_after_fork)

