"""What the bench measures side by side: a *system* saves a workload's state one way.

Call order, per system and workload (the runner keeps it):
  ``unavailable(wl)`` -> ``setup(wl)`` (untimed: allocations a real user makes once) ->
  ``save(wl, i)`` repeatedly, each returning a :class:`SaveHandle` as soon as the program may
  run its next step -> ``restore(wl, target)`` (optional) -> ``teardown()``.

A save has three moments, as DCP's ``async_save`` names them: the *call* returns (the
program may run again), the state is *captured* (it may mutate freely), and it is *durable*
(on its target). Blocking systems reach all three when the call returns.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from gpusnap.bench.workloads import Hook, Workload
from gpusnap.storage.backend import fsync_tree

__all__ = [
    "RestoreResult",
    "SaveHandle",
    "System",
    "Unavailable",
    "blocking_handle",
    "dir_bytes",
    "fsync_tree",
    "sync",
]


class Unavailable(Exception):
    """Raised by a system that found, while running, that it cannot run here; the row records
    ``unavailable: <message>`` instead of a failure."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class SaveHandle:
    """One save as the bench sees it; times are ``time.perf_counter()`` values.

    ``captured_at`` / ``durable_at`` come from the system itself where it can say (DCP's
    futures call back; gpusnap's stats give both after ``wait``), else from ``mark()``, which
    the bench calls after every step (one step of resolution). No polling thread: it would
    take the GIL from the program being measured, and only from the asynchronous systems.
    """

    started: float
    returned: float
    is_captured: Callable[[], bool]
    is_durable: Callable[[], bool]
    wait: Callable[[], dict[str, Any]] = dict  # blocks until durable; returns the system's stats
    before_mutation: Hook | None = None
    captured_at: float | None = None
    durable_at: float | None = None
    durable_note: str | None = None  # e.g. "host memory only: never durable"

    def mark(self) -> None:
        now = time.perf_counter()
        if self.captured_at is None and self.is_captured():
            self.captured_at = now
        if self.durable_at is None and self.is_durable():
            self.durable_at = now


def writer_handle(started: float, write: Future[float]) -> SaveHandle:
    """A save captured by the time it returned, durable when ``write`` (a background
    writer's future, whose result is the perf_counter time it finished) is done."""
    handle = SaveHandle(started=started, returned=time.perf_counter(), is_captured=lambda: True,
                        is_durable=write.done)
    handle.captured_at = handle.returned

    def wait() -> dict[str, Any]:
        handle.durable_at = write.result()
        return {}

    handle.wait = wait
    return handle


def blocking_handle(started: float, stats: dict[str, Any] | None = None, *, durable: bool = True) -> SaveHandle:
    """A save whose call returned with the state captured (and durable unless told)."""
    now = time.perf_counter()
    return SaveHandle(
        started=started,
        returned=now,
        is_captured=lambda: True,
        is_durable=lambda: True,
        wait=lambda: dict(stats or {}),
        captured_at=now,
        durable_at=now if durable else None,
        durable_note=None if durable else "host memory only: never durable",
    )


@dataclass
class RestoreResult:
    """``eager_s``: restore until every byte is back; ``first_step_s``: one step after it.
    ``lazy_*``: the same with a lazy restore (None when the system has none)."""

    eager_s: float | None = None
    first_step_s: float | None = None
    lazy_return_s: float | None = None
    lazy_first_step_s: float | None = None
    lazy_total_s: float | None = None
    notes: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)  # the system's own restore stats


class System:
    """Base class; subclasses override what they support."""

    key = "system"
    label = "system"
    family = "baseline"
    target = "-"
    measures_throughput = False  # every-N throughput measured, else derived from the stall
    measures_restore = True  # False: its restore path is another row's (said in its notes)
    max_saves: int | None = None  # fewer measured saves than the run's --saves (slow targets)

    def unavailable(self, wl: Workload) -> str | None:
        """Why this system cannot run on ``wl`` here ("skipped: no CUDA"...), or None."""
        return None

    gap_steps = 3  # plain steps before each measured save (incremental saves use 1)

    def setup(self, wl: Workload) -> None:
        """Untimed preparation (buffers a real program allocates once)."""

    def prepare_save(self, wl: Workload, index: int) -> None:
        """Untimed, before save ``index``: drop checkpoints a user would have rotated away."""

    def settle(self, wl: Workload) -> None:
        """Untimed, before a throughput run: wait for what earlier saves set going in the
        background and a long-running program would long have finished (slab preparation)."""

    def save(self, wl: Workload, index: int) -> SaveHandle:
        raise NotImplementedError

    def restore(self, wl: Workload, target: Workload) -> RestoreResult | None:
        """Restore the latest save into ``target`` (a fresh instance); None if unsupported."""
        return None

    def verify(self, wl: Workload, target: Workload, index: int, expected: dict[str, torch.Tensor]) -> tuple[bool, str] | None:
        """Restore save ``index`` into ``target`` and compare with ``expected``; None if unsupported."""
        return None

    def self_check(self) -> tuple[bool, str] | None:
        """A correctness check of the system's own round trip (None: nothing to check)."""
        return None

    def bytes_on_disk(self) -> int | None:
        return None

    def pinned_bytes(self) -> int | None:
        """Pinned host bytes this system holds that torch's host allocator stats miss."""
        return None

    def notes(self) -> list[str]:
        return []

    def teardown(self) -> None:
        """Release everything (files, pinned buffers, processes)."""


def dir_bytes(path: str) -> int:
    """Apparent size of every regular file under ``path`` (a file or a directory)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total


