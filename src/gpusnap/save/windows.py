"""The capture windows a Checkpointer has open: opening one for a save, and forgetting
each once it has closed and its tracker is off its thread's dispatch-mode stack."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from gpusnap.capture.concurrent import ConcurrentSave
from gpusnap.capture.trace import Trace
from gpusnap.handles import SaveCompletion
from gpusnap.save.fast_room import reserve_fast
from gpusnap.save.planner import CapturePlanner
from gpusnap.save.tiers import Tiers
from gpusnap.state.flatten import FlatState
from gpusnap.storage.fast_tier import FastTier
from gpusnap.storage.repository import Repository

__all__ = ["Windows"]


class Windows:
    """``lock`` is the save path's (it also guards the pending saves and the retries)."""

    def __init__(self, lock: threading.RLock, planner: CapturePlanner, tiers: Tiers, io_pool: ThreadPoolExecutor,
                 copier_runner: ThreadPoolExecutor) -> None:
        self._lock = lock
        self._open: list[ConcurrentSave] = []
        self._planner = planner
        self._tiers = tiers
        self._io_pool = io_pool
        self._copier_runner = copier_runner  # one long-lived thread runs each window's copier in turn

    def open(self, repo: Repository, flat: FlatState, completion: SaveCompletion, phases: dict[str, float],
             others_busy: Callable[[], bool]) -> ConcurrentSave | None:
        """Open the capture window of a save of ``flat`` into ``repo`` and start its copier;
        None when the fast tier has no room and ``when_busy="skip"``."""
        config = self._planner.config
        previous, compare = self._planner.previous(repo)
        capture: ConcurrentSave | None = None
        fast_txn = None
        try:
            cuda, device_bytes = self._planner.history.devices(flat)
            if isinstance(repo, FastTier):
                reserving = time.perf_counter()
                fast_txn = reserve_fast(self._tiers, repo, flat, others_busy)
                phases["reserve_fast"] = time.perf_counter() - reserving
                if fast_txn is None:
                    return None
            staging = self._planner.staging_for(cuda, device_bytes, fast_txn, phases)
            opened = time.perf_counter()
            plan = self._planner.plan(flat, cuda, staging, previous, compare, phases)
            # The window's own tensors (snapshots, hash tables) are written later by gpusnap's
            # threads, which are never in inference mode: made inside it (a save from a
            # serving loop), they would refuse those writes. Only the construction: a
            # tracker pushed inside this block would lose its dispatch key when it exits.
            with torch.inference_mode(False):
                capture = ConcurrentSave(
                    flat,
                    # opened by the writers, off save()'s time (the fast tier's at once: it reserves)
                    repo.begin_write if fast_txn is None else (lambda: fast_txn),
                    plan.options,
                    staging=plan.staging,
                    io_pool=self._io_pool,
                    streams=dict(plan.streams),
                    trace=Trace(completion.id) if config.trace_dir else None,
                    copier_runner=self._copier_runner,
                )
            if fast_txn is not None:
                capture.txn  # noqa: B018  (bound now: a failed save aborts it with the capture's)
            window = capture.window
            window.on_close(lambda: completion.set_staged() if window.error is None else None)
            starting = time.perf_counter()
            with self._lock:  # listed first: its tracker is popped (reap) whatever happens
                self._open.append(capture)
            capture.start()
            phases["open_window"] = time.perf_counter() - opened
            phases.update({f"open_window.{k}": v for k, v in capture.phases.items()},
                          **{"open_window.start": time.perf_counter() - starting})
        except BaseException as exc:  # (Ctrl-C included): the window closes, its copier stops
            if capture is not None:
                capture.close_out(exc)
                self.reap()
            if fast_txn is not None:
                fast_txn.abort()
            raise
        return capture

    def newest(self) -> ConcurrentSave | None:
        """The window opened last, while listed."""
        with self._lock:
            return self._open[-1] if self._open else None

    def listed(self) -> int:
        """Windows not yet forgotten (closed ones stay until their tracker is popped)."""
        with self._lock:
            return len(self._open)

    def any_open(self) -> bool:
        with self._lock:
            return any(not c.window.closed for c in self._open)

    def wait_captured(self) -> None:
        """Wait until every open window has captured (one window at a time)."""
        with self._lock:
            windows = list(self._open)
        for capture in windows:
            capture.wait_captured()

    def reap(self) -> None:
        """Pop closed windows' trackers on this thread; forget windows fully closed. Any
        thread may call it."""
        with self._lock:
            windows = list(self._open)
        for capture in windows:
            capture.reap()
            if capture.window.closed and _tracker_gone(capture):
                with self._lock:
                    if capture in self._open:  # (another thread may have forgotten it first)
                        self._open.remove(capture)


def _tracker_on_stack(capture: ConcurrentSave) -> bool:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return capture.owner == threading.get_ident() and capture.tracker in _get_current_dispatch_mode_stack()


def _tracker_gone(capture: ConcurrentSave) -> bool:
    """Whether a closed window's tracker is off its thread's mode stack. Only that thread can
    pop it (modes are thread-local), at its next gpusnap call: until then another thread must
    keep the window listed, or the tracker would stay pushed for good."""
    if not capture.tracked:
        return True
    if capture.owner == threading.get_ident():
        return not _tracker_on_stack(capture)
    return all(t.ident != capture.owner for t in threading.enumerate())  # its thread has ended
