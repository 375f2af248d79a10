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
    promoter thread:  the durable manifest read back (and remembered: listed, its tag taken)

A cancel while the helper works is forwarded at once (it stops before its next run or check);
the commit waits for the program's "go", so :meth:`CancelToken.cancel` and the commit still
exclude each other, and a program that died never gets a commit (end of input: called off).

Protocol: 8-byte little-endian length, then a ``marshal`` body, over two pipes of the helper's
own (its stdin and stdout are /dev/null, its stderr the program's: nothing printed at its
start reaches them); each message after "hello" names its job. Only local roots are
promoted here; the program's threads do the rest (:func:`process_usable`).

>>> helper = PromotionProcess(Config())                        # doctest: +SKIP
>>> helper.promote(tier, manifest, durable, cancel=CancelToken(), workers=4)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import marshal
import os
import select
import struct
import subprocess
import sys
import threading
import weakref
from typing import Any

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
MAX_MESSAGE = 64 << 20  # a longer one is nonsense (the largest is a job: a few KiB)
# a helper not ready by then never will be (importing torch and starting CUDA: seconds)
START_TIMEOUT_S = 120.0
CLOSE_TIMEOUT_S = 10.0  # close(): then a helper still there is killed
# the helper's CheckpointErrors are the promotion's own failures (the threads would meet them
# too), raised as their class where it is one of these; anything else is the helper's, and
# the threads take over
_FAILURES: dict[str, type[CheckpointError]] = {e.__name__: e for e in (
    IntegrityError, StorageError, PromotionCancelled, CheckpointNotFoundError, CheckpointError)}
# the helper's first lines: the program's sys.path (its first message), then the helper
_BOOT = """import marshal, os, struct, sys
def _take(n):
    got = b""
    while len(got) < n:
        part = os.read({r}, n - len(got))
        if not part:
            raise SystemExit(0)
        got += part
    return got
sys.path[:] = marshal.loads(_take(struct.unpack("<Q", _take(8))[0]))[1]
from gpusnap.storage.promote_worker import main
main({r}, {w})
"""


class HelperUnavailable(CheckpointError):
    """The helper could not start, ended without an answer, answered nonsense or failed in a
    way of its own: nothing was committed by it, and the program's threads take promotions over."""


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
    """The next message on ``fd``: EOFError at its end (the other side is gone), ValueError
    for what is no message of ours."""
    (n,) = LEN.unpack(_read_exactly(fd, LEN.size))
    if n > MAX_MESSAGE:
        raise ValueError(f"a message of {n} bytes")
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
    one promotion at a time. ``cpu_s``: the helper's CPU seconds (all its threads) so far,
    its start included (importing torch, CUDA)."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._proc: subprocess.Popen[bytes] | None = None
        self._to: int | None = None  # our ends of its channel
        self._from: int | None = None
        self._lock = threading.Lock()  # one promotion at a time
        self._send_lock = threading.Lock()  # (a cancel is sent from the canceller's thread)
        self._jobs = 0
        self._closed = False
        self.cpu_s = 0.0
        _helpers.add(self)

    # -- the helper's life ---------------------------------------------------------------
    def _started(self, device: str | None) -> None:
        if self._closed:
            raise HelperUnavailable("the promotion helper is closed")
        if self._proc is not None:
            if self._proc.poll() is not None:
                raise HelperUnavailable(f"the promotion helper ended (exit code {self._proc.returncode})")
            return
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        # the channel on pipes of its own, so that nothing printed at its start (a
        # sitecustomize) can reach it; its first message the program's sys.path, so that it
        # imports the modules this program does, from where this program does
        code = _BOOT.format(r=to_r, w=from_w)
        try:
            # its own session: a Ctrl-C at the terminal is the program's to handle, not the
            # helper's (it ends when the program's end of the channel closes)
            self._proc = subprocess.Popen([sys.executable, "-I", "-c", code], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, pass_fds=(to_r, from_w), close_fds=True,
                                          start_new_session=True)
        except (OSError, ValueError) as exc:
            for fd in (to_r, to_w, from_r, from_w):
                os.close(fd)
            raise HelperUnavailable(f"the promotion helper could not start: {exc}") from exc
        os.close(to_r)  # (the helper's ends: it has its own copies)
        os.close(from_w)
        self._to, self._from = to_w, from_r
        self._send(("path", [os.fspath(p) for p in sys.path if isinstance(p, (str, os.PathLike))]))
        self._send(("hello", dataclasses.asdict(self._config), device))
        ready = self._receive(START_TIMEOUT_S)
        if not (isinstance(ready, tuple) and len(ready) == 3 and ready[0] == "ready"):
            self._kill()
            raise HelperUnavailable(f"the promotion helper did not start: {ready!r:.300}")
        ours = package_dir()
        if ready[2] != ours:  # (a sys.path changed since this program imported gpusnap)
            self._kill()
            raise HelperUnavailable(f"the promotion helper imported gpusnap from {ready[2]!r}, this program "
                                    f"from {ours!r}")
        self.cpu_s = float(ready[1])

    def close(self) -> None:
        """End the helper (end of its input; killed if still there after ``CLOSE_TIMEOUT_S``)."""
        with self._lock:
            self._closed = True
            self._end(CLOSE_TIMEOUT_S)

    def _kill(self) -> None:
        self._end(0.0)

    def _end(self, grace: float) -> None:
        proc, self._proc = self._proc, None
        with self._send_lock:  # (a cancel being sent never writes to a number reused meanwhile)
            ends, self._to, self._from = (self._to, self._from), None, None
            for fd in ends:
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
        if proc is None:
            return
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    # -- messages --------------------------------------------------------------------------
    def _send(self, message: Any) -> None:
        with self._send_lock:
            fd = self._to
            if fd is None:
                raise HelperUnavailable("the promotion helper is gone")
            try:
                write_message(fd, message)
            except (OSError, ValueError) as exc:
                code = self._proc.poll() if self._proc is not None else None
                raise HelperUnavailable(f"the promotion helper is gone (exit code {code})") from exc

    def _receive(self, timeout: float | None = None) -> Any:
        """The helper's next message; HelperUnavailable (and the helper killed) when it
        ends first, sends what is no message, or (``timeout``) is silent that long."""
        fd = self._from
        if fd is None:
            raise HelperUnavailable("the promotion helper is gone")
        try:
            if timeout is not None and not select.select([fd], [], [], timeout)[0]:
                raise TimeoutError(f"no answer within {timeout:.0f} s")
            return read_message(fd)
        except (OSError, EOFError, ValueError, TypeError) as exc:
            proc = self._proc
            self._kill()
            what = f"exit code {proc.returncode}" if proc is not None else "gone"
            raise HelperUnavailable(f"the promotion helper ended or failed to answer ({what}): "
                                    f"{type(exc).__name__} {exc}".rstrip()) from exc

    # -- a promotion -------------------------------------------------------------------------
    def promote(self, fast: FastTier, manifest: Manifest, durable: Repository, *,
                extra_stats: dict[str, object] | None = None, cancel: CancelToken, workers: int) -> Manifest:
        """:func:`~gpusnap.storage.promote.promote` in the helper; returns the durable manifest.
        Raises the promotion's failure (IntegrityError, StorageError, PromotionCancelled), or
        :class:`HelperUnavailable` when the helper could not start, ended first or failed in
        a way of its own (then nothing was committed by it)."""
        device = next((e.device for e in manifest.storages if e.device.startswith("cuda")), None)
        with self._lock:
            self._started(device)
            self._jobs += 1
            job_id = self._jobs
            fast.pin_checkpoint(manifest.id)  # (the helper reads its slab bytes: retention keeps them)
            stop_forwarding = lambda: None  # noqa: E731
            try:
                try:
                    with durable.writing_elsewhere():
                        job = {"fast_root": fast.backend.local_path(""),  # type: ignore[attr-defined]
                               "fast_identity": fast.identity, "durable_root": durable.backend.local_path(""),  # type: ignore[attr-defined]
                               "id": manifest.id, "workers": workers, "extra_stats": dict(extra_stats or {}),
                               "job": job_id}
                        self._send(("job", job))
                        stop_forwarding = cancel.when_cancelled(lambda: self._forward_cancel(job_id))
                        reply = self._receive()
                        if reply == ("commit?", job_id):
                            reply = self._gate(cancel, manifest.id, durable, job_id)
                except BaseException:  # (gone, or our side failed mid-exchange: the channel is out of step)
                    self._kill()
                    raise
                return self._result(reply, manifest.id, durable, job_id, cancel)
            finally:
                stop_forwarding()
                fast.unpin_checkpoint(manifest.id)

    def _forward_cancel(self, job_id: int) -> None:
        try:
            self._send(("cancel", job_id))
        except HelperUnavailable:
            pass  # (gone: it commits nothing without our "go")

    def _gate(self, cancel: CancelToken, checkpoint_id: str, durable: Repository, job_id: int) -> Any:
        """The helper asks to commit: "go" under the token (a cancel() waits for the answer
        that follows), else "no"; returns the helper's last answer."""
        try:
            with cancel.committing(checkpoint_id):
                self._send(("go", job_id))
                try:
                    return self._receive()
                except HelperUnavailable as gone:
                    # it ended after our "go": committed or not, the root says which
                    try:
                        durable.load_manifest(checkpoint_id)
                    except CheckpointNotFoundError:
                        raise gone from None
                    return ("done", job_id, None)
        except PromotionCancelled:
            self._send(("no", job_id))
            return self._receive()

    def _result(self, reply: Any, checkpoint_id: str, durable: Repository, job_id: int,
                cancel: CancelToken) -> Manifest:
        if isinstance(reply, tuple) and len(reply) == 3 and reply[:2] == ("done", job_id):
            if isinstance(reply[2], (int, float)):
                self.cpu_s = float(reply[2])
            promoted = durable.load_manifest(checkpoint_id)
            durable.remember_committed(promoted)  # (listed, and its tag taken, as if we had committed it)
            return promoted
        if isinstance(reply, tuple) and len(reply) == 6 and reply[:2] == ("error", job_id):
            _, _job, kind, text, cpu, ours = reply
            if isinstance(cpu, (int, float)):
                self.cpu_s = float(cpu)
            if cancel.cancelled:  # (called off: what it met after that is no failure)
                raise PromotionCancelled(f"the promotion of {checkpoint_id} was called off: nothing was committed")
            if ours is True:
                failure = _FAILURES.get(kind)
                raise failure(text) if failure is not None else CheckpointError(f"{kind}: {text}")
            self._kill()
            raise HelperUnavailable(f"the promotion helper failed: {kind}: {text}")
        self._kill()
        raise HelperUnavailable(f"the promotion helper answered {reply!r:.200}")


def package_dir() -> str:
    """The directory of the gpusnap package this process imported."""
    return os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


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
        for fd in (helper._to, helper._from):  # (held here, they would keep the helper from its end)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        helper._to = helper._from = None


at_fork(after_in_child=_after_fork)

