"""``gpusnap.pool.Pool``: processes kept ready to serve a root's checkpoints.

Life cycle::

    Pool(root, entry, size)   starts ``size`` processes (``child.Child``); each imports torch and
                              the entry's module, creates its CUDA context, builds the model
                              empty, warms it up, and says "ready" (``worker``)
    take(checkpoint, params)  the oldest ready process restores ``checkpoint`` into its model and
                              says "loaded": returned as a ``PoolProcess``, running the entry; a
                              replacement starts behind it (whatever the load's outcome)
    close()                   SIGTERM to every process (idle, starting, taken), SIGKILL after a
                              grace; returns once all are reaped

Failures: a process that fails to start (an exception: an import, the build, a busy device)
is not restarted, since the next would fail the same way; ``take()`` raises its error once no
process is ready or starting. One that dies without a word (a signal) before it is ready is
restarted, up to :data:`MAX_DEATHS` times in a row; one that dies while ready is replaced.
A take whose process fails or dies before saying every weight is in place raises, and that
process is reaped: no model is served half-loaded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from gpusnap.config import Config
from gpusnap.pool.child import Child, Output
from gpusnap.pool.entry import entry_name
from gpusnap.pool.handle import STOP_GRACE_S, PoolProcess
from gpusnap.pool.messages import PoolError, as_params, raise_error

__all__ = ["MAX_DEATHS", "Pool"]

log = logging.getLogger("gpusnap")

MAX_DEATHS = 3  # starts in a row that died without a word before the pool stops starting more


class Pool:
    """``size`` processes ready to serve ``root``'s checkpoints through ``entry``.

    ``entry``: the entry function (decorated with :func:`gpusnap.pool.entry`), or its name
    ``"module:function"``; the processes import it (with this process's ``sys.path``).
    ``device``: where the models are built (``cuda:N``; default: ``cuda`` when present,
    else ``cpu``). ``key``: the checkpoint entry that holds the model (default: found as
    ``gpusnap.cold_start`` finds it). ``config``: the processes' Checkpointer config (default:
    ``Config.from_env(warm_up_kernels=False)`` there). ``env``: variables added to the
    processes' environment. ``stdout``/``stderr``: where their output goes (as
    ``subprocess.Popen``'s; default: this process's). ``on_event(dict)``: one call per event
    (``pool-started``, ``pool-ready``, ``pool-failed``, ``pool-died``, ``pool-taken``,
    ``pool-loaded``, ``pool-exited``), from the pool's threads.

    Each process holds its model in device memory while it waits: ``size`` idle models, plus
    those taken and serving.

    >>> with gpusnap.pool.Pool("/dev/shm/run1/ckpt", "my_server:serve", size=2) as pool:  # doctest: +SKIP
    ...     proc = pool.take()           # the newest checkpoint, in a warm process
    ...     proc.wait()
    """

    def __init__(self, root: str | os.PathLike[str], entry: str | Callable[..., Any], size: int = 1, *,
                 device: str | torch.device | None = None, key: str | None = None, config: Config | None = None,
                 env: Mapping[str, str] | None = None, stdout: Output = None, stderr: Output = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        name = self.check(entry, size)
        if device is not None:
            parsed = torch.device(device)
            if parsed.type not in ("cuda", "cpu"):
                raise ValueError(f"a pool's device is cuda, cuda:N or cpu, not {device!r}")
            device = str(parsed)
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be a gpusnap.Config, got {type(config).__name__}")
        extra = dict(env or {})
        bad = [k for k, v in extra.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise TypeError(f"env maps names to strings; not {bad!r}")
        self.root = os.fspath(root)
        self.entry = name
        self.size = size
        self.device = device
        self._start = {"op": "start", "root": self.root, "entry": self.entry, "device": device, "key": key,
                       "config": dataclasses.asdict(config) if config is not None else None,
                       "sys_path_json": json.dumps(sys.path)}
        self._env = {**os.environ, **extra}
        self._stdout, self._stderr = stdout, stderr
        self._on_event = on_event
        self._cond = threading.Condition()  # (reentrant: a process's reader starts its replacement under it)
        self._idle: list[Child] = []  # starting or ready
        self._taken: list[Child] = []  # loading or serving
        self._failures: list[str] = []  # why starts failed (those are not restarted)
        self._deaths = 0
        self._seq = 0
        self._closed = False
        try:
            for _ in range(size):
                self._emit_all(self._start_one())
        except BaseException:
            self.close()
            raise

    @staticmethod
    def check(entry: str | Callable[..., Any], size: int) -> str:
        """The entry's ``module:function`` name; ``ValueError``/``TypeError`` for an entry a
        process could not import by name, or a size that is not a positive integer."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"a pool's size is a positive integer, got {size!r}")
        return entry_name(entry)

    # -- the public calls ----------------------------------------------------------------------
    def take(self, checkpoint: str | None = None, *, params: Mapping[str, Any] | None = None,
             timeout: float | None = None) -> PoolProcess:
        """Hand the oldest ready process ``checkpoint`` (an id or a tag; None: the newest)
        and return once every weight is in place and the entry runs.

        ``params`` (JSON) reaches the entry as ``ready.params``. Waits for a process to be
        ready if none is (at most ``timeout`` seconds in all: ``TimeoutError``; a process
        still loading then is killed). Raises the load's error (``RestoreMismatchError``
        when the checkpoint does not fit the model built, ``CheckpointNotFoundError``, ...)
        or :class:`PoolError` (no process can start, or the one taken died); either way the
        process is gone and a replacement starts.
        """
        if checkpoint is not None and not isinstance(checkpoint, str):
            raise TypeError(f"checkpoint is an id or a tag (a string) or None, got {checkpoint!r}")
        sent = as_params(params)
        asked = time.perf_counter()
        deadline = None if timeout is None else time.monotonic() + timeout
        child = self._pick(deadline)
        try:
            child.take(checkpoint, sent)
            self._emit({"event": "pool-taken", "pid": child.pid, "checkpoint": checkpoint})
            with self._cond:
                done = self._cond.wait_for(lambda: child.state in ("serving", "ended") or child.error is not None,
                                           _left(deadline))
                state, error = child.state, child.error
            if state == "serving":
                proc = PoolProcess(child, self._stats(child, asked))
                self._emit({"event": "pool-loaded", "pid": proc.pid, "checkpoint": proc.checkpoint,
                            "take_s": proc.stats["take_s"], "source": proc.stats.get("source")})
                return proc
            child.end(0.0 if not done else STOP_GRACE_S)  # (reaped: nothing of it serves)
            asked_for = f"checkpoint {checkpoint!r}" if checkpoint is not None else "the newest checkpoint"
            where = f"pool process {child.pid} could not load {asked_for} of {self.root}"
            if not done:
                raise TimeoutError(f"{where} within {timeout} s: it was killed")
            if error is not None:
                raise_error(error, where)
            if self._closed:
                raise PoolError(f"{where}: the pool was closed")
            raise PoolError(f"{where}: it ended ({child.why_ended()}) before every weight was in place; "
                            "nothing of it serves")
        finally:
            self._emit_all(self._start_one())  # the replacement (none once closed)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Until ``size`` processes are ready to be taken (the replacements of those taken
        included). Raises :class:`PoolError` when some cannot start, ``TimeoutError`` after
        ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise PoolError("the pool is closed")
                if self._idle and all(c.state == "ready" for c in self._idle) and len(self._idle) == self.size:
                    return
                if len(self._idle) < self.size and not any(c.state == "starting" for c in self._idle) and \
                        self._failures:
                    raise PoolError(f"pool processes of {self.entry} could not start: {self._failures[-1]}")
                if not self._cond.wait(_left(deadline)):
                    raise TimeoutError(f"the pool's processes were not all ready within {timeout} s")

    @property
    def ready_pids(self) -> list[int]:
        """The pids of the processes ready to be taken, oldest first."""
        with self._cond:
            return [c.pid for c in self._idle if c.state == "ready"]

    def close(self, timeout: float = STOP_GRACE_S) -> None:
        """Stop every process of the pool, taken ones included (SIGTERM, then SIGKILL after
        ``timeout`` seconds) and reap them all. Idempotent."""
        with self._cond:
            self._closed = True
            everyone = self._idle + self._taken
            self._cond.notify_all()
        for child in everyone:  # (all at once, then each waited for)
            child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in everyone:
            child.end(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Pool({self.root!r}, {self.entry!r}, size={self.size}, ready={len(self.ready_pids)})"

    # -- inside ----------------------------------------------------------------------------------
    def _start_one(self) -> list[dict[str, Any]]:
        """Start a process (none once closed); its event, to emit once the condition is
        released (``on_event`` never runs under it)."""
        with self._cond:
            if self._closed:
                return []
            child = Child(self._seq, self._start, env=self._env, stdout=self._stdout, stderr=self._stderr,
                          cond=self._cond, on_change=self._changed, emit=self._emit)
            self._seq += 1
            self._idle.append(child)
        return [{"event": "pool-started", "pid": child.pid, "seq": child.seq}]

    def _pick(self, deadline: float | None) -> Child:
        """The oldest ready process, now ``loading`` and out of the idle list."""
        with self._cond:
            while True:
                if self._closed:
                    raise PoolError("the pool is closed")
                ready = [c for c in self._idle if c.state == "ready"]
                if ready:
                    child = ready[0]
                    self._idle.remove(child)
                    child.state = "loading"
                    self._taken.append(child)
                    return child
                if not any(c.state == "starting" for c in self._idle):
                    why = self._failures[-1] if self._failures else "none is left"
                    raise PoolError(f"no pool process of {self.entry} can be had: {why}")
                if not self._cond.wait(_left(deadline)):
                    raise TimeoutError("no pool process was ready in time")

    def _changed(self, child: Child) -> list[dict[str, Any]]:
        """A process said something or ended (its reader thread, the condition held): keep
        the lists, start replacements; the events for ``on_event``."""
        if child.state == "ready" and child in self._idle and not child.announced:
            child.announced = True
            self._deaths = 0
            timings = {k: child.ready.get(k) for k in ("device", "import_s", "cuda_s", "build_s", "warm_up_s")}
            return [{"event": "pool-ready", "pid": child.pid, "start_s": child.ready_at - child.started_at, **timings}]
        if child.state == "ended" and child in self._idle:
            self._idle.remove(child)
            return [] if self._closed else self._replace(child)
        if child.state == "ended" and child in self._taken:
            self._taken.remove(child)
            return [{"event": "pool-exited", "pid": child.pid, "returncode": child.returncode,
                     "why": None if child.returned else child.why_ended()}]
        return []

    def _replace(self, child: Child) -> list[dict[str, Any]]:
        """An idle process ended (under the condition): restart it, or give up on it."""
        why = child.why_ended()
        if child.ready:  # it was ready: something outside killed it
            return [{"event": "pool-died", "pid": child.pid, "why": why, "replaced": True}, *self._start_one()]
        if child.error is None:
            self._deaths += 1
        if child.error is None and self._deaths < MAX_DEATHS:
            return [{"event": "pool-died", "pid": child.pid, "why": f"{why} while starting", "replaced": True},
                    *self._start_one()]
        self._failures.append(f"process {child.pid}: {why}")
        log.error("gpusnap pool: a process of %s could not start (not restarted): %s", self.entry, why)
        if child.error is not None and child.error.get("traceback"):
            log.debug("%s", child.error["traceback"])
        return [{"event": "pool-failed", "pid": child.pid, "why": why}]

    def _stats(self, child: Child, asked: float) -> dict[str, Any]:
        assert child.loaded is not None
        stats = dict(child.loaded.get("stats") or {})
        stats["take_s"] = time.perf_counter() - asked
        stats["start_s"] = child.ready_at - child.started_at
        return stats

    def _emit_all(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            self._emit(event)

    def _emit(self, event: dict[str, Any]) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(event)
        except Exception:  # noqa: BLE001 (a broken printer must not stop the pool)
            log.exception("gpusnap pool: on_event failed")


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
