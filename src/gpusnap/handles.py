"""What ``save()`` and ``restore()`` hand back: futures with stats, and the checkpoint info."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpusnap.errors import CheckpointError

__all__ = ["CheckpointInfo", "PendingSave", "RestoreHandle"]

_RETRY_POLL_S = 0.05  # how often a waiting thread checks for a retry it must start


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint.

    ``stats`` holds (seconds and bytes): ``stall_s``, ``duration_s``, ``bytes_total``,
    ``bytes_copied``, ``bytes_cow``, ``bytes_skipped``, ``validation``.
    """

    id: str
    tag: str | None
    created: float
    nbytes: int
    stats: dict[str, Any] = field(default_factory=dict)


class _Completion:
    """A one-shot result or error, settable from a background thread."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def set(self, value: Any) -> None:
        self._value = value
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait_for(self, seconds: float | None) -> bool:
        return self._event.wait(seconds)

    def result(self, timeout: float | None, what: str) -> Any:
        if not self._event.wait(timeout):
            raise TimeoutError(f"{what} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value


class PendingSave:
    """A save in progress. Two moments: *staged* (state captured; the program may mutate
    freely) and *durable* (committed; :meth:`wait` returns its :class:`CheckpointInfo`).

    >>> pending = ckpt.save(app_state)      # doctest: +SKIP
    >>> info = pending.wait()               # doctest: +SKIP
    """

    def __init__(self, checkpoint_id: str, tag: str | None) -> None:
        self.id = checkpoint_id
        self.tag = tag
        self.stats: dict[str, Any] = {}
        self._staged = _Completion()
        self._durable = _Completion()
        self._on_wait: Callable[[], None] | None = None  # pops a closed window's tracker

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
        finally:
            self._reap()

    def done(self) -> bool:
        """True once the save is committed or has failed."""
        return self._durable.done()

    def wait(self, timeout: float | None = None) -> CheckpointInfo:
        """Block until durable; returns the info, or raises the save's error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            # a save that failed validation is retried on this thread: look for it while waiting
            while not self._durable.done():
                self._reap()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._durable.wait_for(_RETRY_POLL_S if left is None else min(_RETRY_POLL_S, left))
            return self._durable.result(0, f"checkpoint {self.id}")  # type: ignore[no-any-return]
        finally:
            self._reap()

    def _set_staged(self) -> None:
        self._staged.set(None)

    def _finish(self, info: CheckpointInfo) -> None:
        self.stats = dict(info.stats)
        self._staged.set(None)
        self._durable.set(info)

    def _fail(self, error: BaseException) -> None:
        if not isinstance(error, CheckpointError):
            wrapped = CheckpointError(f"checkpoint {self.id} failed: {error}")
            wrapped.__cause__ = error
            error = wrapped
        if not self._staged.done():
            self._staged.fail(error)
        self._durable.fail(error)

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
    ``restore()`` to the program's first touch of it during a lazy restore).

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
