"""What ``Pool.take()`` returns: :class:`PoolProcess`, the handle of a process serving a
checkpoint, and :class:`Exited`, how it ended."""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpusnap.pool.child import Child

__all__ = ["Exited", "PoolProcess"]

STOP_GRACE_S = 10.0  # stop(): SIGTERM, then SIGKILL after this long


@dataclass(frozen=True)
class Exited:
    """How a taken process ended. ``returncode``: 0 when the entry returned, 1 when it
    raised, ``-N`` when signal N ended it. ``value``: what the entry returned (JSON), else
    None. ``error``: None when the entry returned, else what happened (``"ValueError: ..."``,
    ``"killed by SIGKILL"``)."""

    returncode: int
    value: Any = None
    error: str | None = None


class PoolProcess:
    """A pool process that was handed a checkpoint and runs the entry function.

    ``pid``; ``checkpoint``: the id it restored; ``device``; ``stats``: how it got there
    (``source``: ``"server"`` or ``"files"``; ``restore_s``; ``take_s``: from ``take()``
    until every weight was in place; ``start_s``: from the process's launch until it was
    ready; ``import_s``, ``cuda_s``, ``build_s``, ``warm_up_s``: its start, step by step;
    and the restore's ``handle.stats``).

    >>> proc = pool.take()                    # doctest: +SKIP
    >>> proc.pid, proc.checkpoint, proc.stats["source"]  # doctest: +SKIP
    >>> proc.wait().value                     # what the entry returned  # doctest: +SKIP
    """

    def __init__(self, child: Child, stats: Mapping[str, Any]) -> None:
        self._child = child
        assert child.loaded is not None
        self.pid: int = child.pid
        self.checkpoint: str = str(child.loaded.get("checkpoint"))
        self.device: str = str(child.ready.get("device"))
        self.stats: Mapping[str, Any] = stats

    @property
    def alive(self) -> bool:
        """Whether the process still runs (it has not been reaped)."""
        with self._child.cond:
            return self._child.state != "ended"

    def poll(self) -> Exited | None:
        """How it ended, or None while it runs."""
        with self._child.cond:
            return self._exited() if self._child.state == "ended" else None

    def wait(self, timeout: float | None = None) -> Exited:
        """Until the process has ended (``TimeoutError`` after ``timeout`` seconds)."""
        with self._child.cond:
            if not self._child.cond.wait_for(lambda: self._child.state == "ended", timeout):
                raise TimeoutError(f"pool process {self.pid} still runs after {timeout} s")
            return self._exited()

    def stop(self, timeout: float = STOP_GRACE_S) -> Exited:
        """SIGTERM (to it and what it started), SIGKILL if it still runs after ``timeout``
        seconds; returns once it is reaped."""
        self._child.end(timeout)
        with self._child.cond:
            return self._exited()

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to the process (and its group) if it still runs."""
        self._child.send_signal(sig)

    def _exited(self) -> Exited:
        child = self._child
        code = child.returncode if child.returncode is not None else -1
        if child.returned and code == 0:
            return Exited(code, child.value, None)
        return Exited(code, None, child.why_ended())

    def __repr__(self) -> str:
        return f"PoolProcess(pid={self.pid}, checkpoint={self.checkpoint!r}, alive={self.alive})"
