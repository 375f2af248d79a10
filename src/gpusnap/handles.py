"""What ``save()`` and ``restore()`` hand back: futures with stats, and the checkpoint info."""

from __future__ import annotations

import threading
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
        try:
            return self._durable.result(timeout, f"checkpoint {self.id}")  # type: ignore[no-any-return]
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

    ``stats``: ``checkpoint`` (id), ``return_s`` (time until ``restore()`` returned),
    ``total_s``, ``bytes_read``, ``chunks_read``.
    """

    def __init__(self, checkpoint_id: str) -> None:
        self.checkpoint_id = checkpoint_id
        self.stats: dict[str, Any] = {"checkpoint": checkpoint_id}
        self._done = _Completion()

    def done(self) -> bool:
        return self._done.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every byte is restored; raises the restore's error."""
        self._done.result(timeout, f"restore of {self.checkpoint_id}")

    def _finish(self) -> None:
        self._done.set(None)

    def _fail(self, error: BaseException) -> None:
        self._done.fail(error)
