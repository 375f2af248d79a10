"""Reader processes for the restore: one per reader thread, reading pack runs into the shared
host regions (``staging.SlotPool(shared=True)``).

Why processes: the copy thread bounds the restore, and each of its torch calls gives up the
GIL and waits to get it back from whichever reader thread holds it. With the reads in other
processes a reader thread sends one request per batch and sleeps in a blocking pipe read
(GIL released) until the reply: one GIL hand-off per batch instead of one per run plus the
reads' bookkeeping. This restored 1.13-1.42x faster than reader threads (BENCHMARKS.md).

A worker that dies, stops answering (``REPLY_TIMEOUT_S``) or answers nonsense is killed and
raises :class:`ReaderDied`; the loader's thread then reads for itself.

Protocol (``reader_worker.py``): 8-byte little-endian length, then a ``marshal`` body. Request:
a list of runs ``(path, file offset, length, region offset)``. Reply: ``("ok", [bytes got per
run])`` or ``("error", errno, strerror, path)``.

>>> procs = ReaderProcs(2, pool)            # doctest: +SKIP  (pool: SlotPool(shared=True))
>>> procs.read(0, [("/ckpt/packs/p1", 0, 4096, pool.offset_of(region))])  # doctest: +SKIP
[4096]
"""

from __future__ import annotations

import marshal
import os
import select
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

from gpusnap.restore.pipeline.staging import SlotPool

__all__ = ["ReaderDied", "ReaderProcs", "WorkerProcs"]

WORKER = str(Path(__file__).with_name("reader_worker.py"))
LEN = struct.Struct("<Q")
START_TIMEOUT_S = 5.0  # a worker not ready by then never will be (it starts in tens of ms)
REPLY_TIMEOUT_S = 120.0  # a request is at most a region (tens of MiB): a worker this slow is wedged
CLOSE_TIMEOUT_S = 2.0  # close(): then every worker still there is killed


class ReaderDied(RuntimeError):
    """A reader process exited, stopped answering or answered nonsense; it is killed and its
    reads fall back to the thread."""


class WorkerProcs:
    """``n`` worker processes running ``argv``, each sent ``job`` first when given; request
    ``k`` goes to process ``k`` (one thread owns each, so no two threads share a pipe). Each
    says ready in its first message (``"ready"``, or a tuple starting with it; a tuple
    starting with ``"failed"`` is a start that failed), read at its first request or polled
    with :meth:`ready`."""

    kind = "worker"

    def __init__(self, n: int, argv: list[str], *, pass_fds: tuple[int, ...] = (), job: Any = None,
                 start_timeout: float | None = None) -> None:
        self.start_failed = False  # a worker never said ready: the Restorer stops using them
        self.start_timeout = START_TIMEOUT_S if start_timeout is None else start_timeout
        self._procs: list[subprocess.Popen[bytes]] = []
        self.hello: list[Any] = [None] * n  # each process's ready message (None: not read yet)
        self._born = time.monotonic()
        self._lock = threading.Lock()
        first = b"" if job is None else _frame(job)
        try:
            for _ in range(n):  # started at once; each one's ready message is read later
                proc = subprocess.Popen([sys.executable, "-I", "-S", *argv], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, pass_fds=pass_fds, close_fds=True, bufsize=0)
                self._procs.append(proc)
                if first:
                    assert proc.stdin is not None
                    _write_all(proc.stdin.fileno(), first)
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self._procs)

    def ready(self, k: int) -> bool:
        """Whether process ``k`` has said ready, without waiting (False while it starts);
        raises :class:`ReaderDied` when it failed to start or ``start_timeout`` passed."""
        if k < len(self.hello) and self.hello[k] is not None:
            return True
        if k >= len(self._procs):
            raise ReaderDied(f"no {self.kind} process {k} (closed)")
        proc = self._procs[k]
        assert proc.stdout is not None
        # An exited process is read too: its ready message may be in the pipe, and if it is
        # not, it never started (start_failed), however its end was noticed first.
        if proc.poll() is not None or select.select([proc.stdout.fileno()], [], [], 0)[0]:
            self._take_ready(k, proc, self.start_timeout)
            return True
        if time.monotonic() - self._born > self.start_timeout:
            self.start_failed = True
            self._kill(proc, f"did not start within {self.start_timeout:.0f} s")
        return False

    def request(self, k: int, message: Any) -> Any:
        """Send ``message`` to process ``k`` and return its reply (waiting for it to be ready
        first); raises :class:`ReaderDied`."""
        proc = self._proc(k)
        if self.hello[k] is None:
            # its whole start_timeout from its first request: processes are kept across
            # restores, and one may get its first request long after it started
            self._take_ready(k, proc, self.start_timeout)
        try:
            assert proc.stdin is not None
            _write_all(proc.stdin.fileno(), _frame(message))
        except (OSError, ValueError) as exc:
            self._kill(proc, f"is gone (exit code {proc.poll()})", exc)
        return self._recv(proc, REPLY_TIMEOUT_S)

    def _proc(self, k: int) -> subprocess.Popen[bytes]:
        procs = self._procs
        if k >= len(procs):
            raise ReaderDied(f"no {self.kind} process {k} (closed)")
        proc = procs[k]
        if proc.returncode is not None:
            raise ReaderDied(f"{self.kind} process {proc.pid} is gone (exit code {proc.returncode})")
        return proc

    def _take_ready(self, k: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
        try:
            ready = self._recv(proc, timeout)
        except ReaderDied:
            self.start_failed = True
            raise
        if ready != "ready" and not (isinstance(ready, tuple) and ready and ready[0] == "ready"):
            self.start_failed = True
            self._kill(proc, f"did not start: {ready!r:.200}" if isinstance(ready, tuple) else "sent no ready message")
        self.hello[k] = ready

    def _recv(self, proc: subprocess.Popen[bytes], timeout: float) -> Any:
        """One message, within ``timeout`` seconds; else the process is killed (ReaderDied)."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        try:
            data = _read_some(fd, LEN.size, deadline)  # (a reply is small: mostly all of it at once)
            (n,) = LEN.unpack(data[: LEN.size])
            if len(data) < LEN.size + n:
                data += _read_some(fd, LEN.size + n - len(data), deadline)
            if len(data) != LEN.size + n:  # (one request at a time: nothing may follow)
                raise ValueError(f"a reply of {len(data)} bytes, {LEN.size + n} expected")
            return marshal.loads(data[LEN.size :])
        except TimeoutError as exc:
            self._kill(proc, f"did not answer within {timeout:.0f} s", exc)
        except (OSError, ValueError, EOFError) as exc:
            self._kill(proc, f"is gone (exit code {proc.poll()})", exc)

    def _kill(self, proc: subprocess.Popen[bytes], why: str, cause: BaseException | None = None) -> NoReturn:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise ReaderDied(f"{self.kind} process {proc.pid} {why}") from cause

    def alive(self) -> bool:
        return bool(self._procs) and not self.start_failed and all(p.poll() is None for p in self._procs)

    def close(self) -> None:
        """End every process: end of input, then a kill for any still there after
        ``CLOSE_TIMEOUT_S`` (a forked child of the program may hold their pipes open)."""
        with self._lock:
            procs, self._procs = self._procs, []
        for p in procs:
            try:
                if p.stdin is not None:
                    p.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()


class ReaderProcs(WorkerProcs):
    """``n`` reader processes mapping ``pool``'s shared memory; ``read(k, runs)`` uses process ``k``."""

    kind = "reader"

    def __init__(self, n: int, pool: SlotPool) -> None:
        if pool.shared is None:
            raise ValueError("reader processes need a SlotPool made with shared=True")
        self.pool = pool
        fd = pool.shared.fd
        super().__init__(n, [WORKER, str(fd), str(pool.nbytes)], pass_fds=(fd,))

    def read(self, k: int, runs: list[tuple[str, int, int, int]]) -> list[int]:
        """Read ``runs`` in process ``k``; bytes got per run. Raises ``OSError`` (the run's
        errno and path) or :class:`ReaderDied`."""
        return runs_reply(self, k, self.request(k, runs), len(runs))


def runs_reply(procs: WorkerProcs, k: int, reply: Any, n: int) -> list[int]:
    """The bytes got per run from a worker's reply to ``n`` runs; raises ``OSError`` for its
    error reply, or kills it (:class:`ReaderDied`) for anything else."""
    if isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "ok" and isinstance(reply[1], list) and len(reply[1]) == n:
        got: list[int] = reply[1]
        return got
    if isinstance(reply, tuple) and len(reply) == 4 and reply[0] == "error":
        _, errno, strerror, path = reply
        raise OSError(errno, strerror, path)
    procs._kill(procs._procs[k], f"answered {reply!r:.80}")


def _frame(obj: Any) -> bytes:
    body = marshal.dumps(obj)
    return LEN.pack(len(body)) + body


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_some(fd: int, n: int, deadline: float) -> bytes:
    """At least ``n`` bytes from the pipe ``fd`` by ``deadline`` (what is there beyond them
    too, up to 64 KiB a read): TimeoutError, or EOFError at its end. One ``poll`` and one
    ``read`` for a whole small reply: each system call gives up the GIL the copy thread needs."""
    parts: list[bytes] = []
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise TimeoutError
        part = os.read(fd, max(n - got, 1 << 16))
        if not part:
            raise EOFError
        parts.append(part)
        got += len(part)
    return b"".join(parts)
