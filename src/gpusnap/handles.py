"""What ``save()`` and ``restore()`` hand back: futures with stats, and the checkpoint info."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpusnap.errors import CheckpointError

__all__ = ["CheckpointInfo", "PendingSave", "RestoreHandle"]


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint.

    ``stats`` holds (seconds and bytes): ``stall_s``, ``duration_s``, ``bytes_total``,
    ``bytes_copied``, ``bytes_cow``, ``bytes_skipped``, ``validation``.
    ``tier``: ``"durable"`` (the Checkpointer's root; a promoted checkpoint lists so) or
    ``"fast"`` (only in its ``fast_root``). ``world_size``: the ranks that saved it
    together (1: a per-process checkpoint; docs/distributed.md).
    """

    id: str
    tag: str | None
    created: float
    nbytes: int
    stats: dict[str, Any] = field(default_factory=dict)
    tier: str = "durable"
    world_size: int = 1


class _Completion:
    """A one-shot result or error, settable from a background thread (the first one wins)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._value: Any = None
        self._error: BaseException | None = None

    def set(self, value: Any) -> bool:
        with self._lock:
            if self._event.is_set():
                return False
            self._value = value
            self._event.set()
            return True

    def fail(self, error: BaseException) -> bool:
        with self._lock:
            if self._event.is_set():
                return False
            self._error = error
            self._event.set()
            return True

    def done(self) -> bool:
        return self._event.is_set()

    def wait_for(self, seconds: float | None) -> bool:
        return self._event.wait(seconds)

    def error(self) -> BaseException | None:
        return self._error if self._event.is_set() else None

    def value(self) -> Any:
        return self._value if self._event.is_set() else None

    def result(self, timeout: float | None, what: str) -> Any:
        if not self._event.wait(timeout):
            raise TimeoutError(f"{what} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value


class PendingSave:
    """A save in progress. Two moments: *staged* (state captured; the program may mutate
    freely) and *durable* (committed; :meth:`wait` returns its :class:`CheckpointInfo`).

    A failed save's error is *observed* once this handle has raised it (:meth:`wait`,
    :meth:`wait_staged`) or returned it (:meth:`exception`); :meth:`done` alone does not
    observe it. An error nothing observed is raised, once, by the Checkpointer's next
    ``wait()``, ``close()`` or ``with``-block exit, else reported on stderr at
    interpreter exit (docs/guarantees.md).

    >>> pending = ckpt.save(app_state)      # doctest: +SKIP
    >>> info = pending.wait()               # doctest: +SKIP
    """

    def __init__(self, checkpoint_id: str, tag: str | None) -> None:
        self.id = checkpoint_id
        self.tag = tag
        self.stats: dict[str, Any] = {}
        self._staged = _Completion()
        self._durable = _Completion()
        self._observed = False
        self._observed_lock = threading.Lock()
        self._on_wait: Callable[[], None] | None = None  # pops a closed window's tracker
        # blocks until done or the deadline (time.monotonic), running this thread's due
        # retries meanwhile (Checkpointer._wait_for); None: a plain wait
        self._waits: Callable[[PendingSave, float | None], None] | None = None
        self._on_fail: Callable[[PendingSave], None] | None = None  # records an unobserved failure
        self._pid = os.getpid()  # the process whose threads finish it (not a forked child)

    def _reap(self) -> None:
        if self._on_wait is not None:
            self._on_wait()

    def staged(self) -> bool:
        """True once every byte of the state is captured (or the save failed)."""
        return self._staged.done()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the state is captured; raises if capturing failed."""
        try:
            self._staged.result(timeout, f"capture of checkpoint {self.id}")
        except CheckpointError:
            self._mark_observed()
            raise
        finally:
            self._reap()

    def done(self) -> bool:
        """True once the save is committed or has failed."""
        return self._durable.done()

    def wait(self, timeout: float | None = None) -> CheckpointInfo:
        """Block until durable; returns the info, or raises the save's error."""
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self._durable.value()  # type: ignore[no-any-return]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Block until durable like :meth:`wait`; returns the save's error (None once
        committed) instead of raising it. Either way the error counts as observed."""
        self._block(timeout)
        if not self._durable.done():
            raise TimeoutError(f"checkpoint {self.id} did not finish within {timeout} s")
        error = self._durable.error()
        if error is not None:
            self._mark_observed()
        return error

    def _block(self, timeout: float | None) -> None:
        if os.getpid() != self._pid and not self._durable.done():  # (no thread here would finish it)
            raise CheckpointError(
                f"checkpoint {self.id} is being saved by process {self._pid}, which this process was forked from: "
                "only that process finishes it (wait for it there)"
            )
        if self._waits is None:
            self._durable.wait_for(timeout)
            return
        # a save that failed validation is retried on the thread that saved: its waits run it
        self._waits(self, None if timeout is None else time.monotonic() + timeout)

    def _wait_done(self, seconds: float | None) -> bool:
        return self._durable.wait_for(seconds)

    def _error(self) -> BaseException | None:
        return self._durable.error()

    def _info(self) -> CheckpointInfo | None:
        return self._durable.value()  # type: ignore[no-any-return]

    def _mark_observed(self) -> None:
        with self._observed_lock:
            self._observed = True

    def _claim(self) -> bool:
        """True for the first caller once the save has failed unobserved: it reports the error."""
        with self._observed_lock:
            if self._observed or self._durable.error() is None:
                return False
            self._observed = True
            return True

    def _set_staged(self) -> None:
        self._staged.set(None)

    def _finish(self, info: CheckpointInfo) -> None:
        self.stats = dict(info.stats)
        self._staged.set(None)
        self._durable.set(info)

    def _fail(self, error: BaseException) -> None:
        """Fail the save (once: a save already committed or failed stays as it is)."""
        if not isinstance(error, CheckpointError):
            wrapped = CheckpointError(f"checkpoint {self.id} failed: {str(error) or type(error).__name__}")
            wrapped.__cause__ = error
            error = wrapped
        self._staged.fail(error)
        if self._durable.fail(error) and self._on_fail is not None:
            self._on_fail(self)

    def __repr__(self) -> str:
        state = "done" if self.done() else ("staged" if self.staged() else "capturing")
        return f"PendingSave(id={self.id!r}, {state})"


class RestoreHandle:
    """A restore in progress (eager restores are complete when returned).

    ``stats`` (seconds and bytes): ``checkpoint`` (id), ``mode`` ("eager" or "lazy"),
    ``verify`` (how chunks were checked), ``threads`` (readers), ``order`` ("access": the
    order the program touched buffers in the save window; "manifest": storage order),
    ``return_s`` (until ``restore()`` returned), ``total_s`` (until every byte was in place),
    ``bytes_read``, ``chunks_read``, ``waits`` / ``wait_s`` (ops that waited for a buffer not
    yet loaded, and for how long in total), ``opaque_waits`` (CUDA graph replays, Triton or
    compiled launches that waited for everything), ``first_needed`` (key path -> seconds from
    ``restore()`` to the program's first touch of it during a lazy restore), ``skipped_newer``
    (unreadable manifests newer than the checkpoint restored: ``[{"id", "reason"}]``, each
    also named in a WARNING), ``lazy_refused`` (why a ``lazy=True`` restore ran eagerly, e.g.
    inside ``torch.inference_mode()``), ``gate_dropped`` (times a guard no gpusnap hook saw
    dropped the lazy gate's dispatch key, put back at the next gpusnap call), ``missing`` /
    ``unexpected`` (``restore(strict=False)``: dotted key paths only ``app_state``, or only
    the checkpoint, has, which were skipped; empty for a strict restore), ``source``
    (``"server"``: the restore server copied every byte, ``served`` says how; ``"files"``,
    and ``server_fallback`` says why the server did not serve; docs/serve.md).

    >>> h = ckpt.restore(app_state, lazy=True)   # doctest: +SKIP
    >>> out = model(x)                            # doctest: +SKIP
    >>> h.wait(); h.stats["first_needed"]        # doctest: +SKIP
    """

    def __init__(self, checkpoint_id: str) -> None:
        self.checkpoint_id = checkpoint_id
        self.stats: dict[str, Any] = {"checkpoint": checkpoint_id}
        self._done = _Completion()
        self._on_wait: Callable[[], None] | None = None  # pops a finished lazy restore's gate

    def _reap(self) -> None:
        if self._on_wait is not None:
            self._on_wait()

    def done(self) -> bool:
        """True once every byte is restored (or the restore failed)."""
        finished = self._done.done()
        if finished:
            self._reap()
        return finished

    def wait(self, timeout: float | None = None) -> None:
        """Block until every byte is restored; raises the restore's error."""
        try:
            self._done.result(timeout, f"restore of {self.checkpoint_id}")
        finally:
            self._reap()

    def _finish(self) -> None:
        self._done.set(None)

    def _fail(self, error: BaseException) -> None:
        self._done.fail(error)

    def __repr__(self) -> str:
        state = "done" if self._done.done() else "loading"
        return f"RestoreHandle({self.checkpoint_id!r}, {state})"
