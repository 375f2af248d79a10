"""Prepare a fast tier's slabs on a background thread, ahead of the saves that need them.

A slab is ready once its file is allocated, mapped and page-locked
(``FastTier.slab_memory``). That costs ~0.5 s per GiB of a thread's time, whoever does it,
and, done a GiB per call, ~90 ms per GiB of the training it runs beside: populating and
page-locking are long kernel and driver calls that the program's CUDA calls wait behind. A
save whose copier has to do it waits for it (its window lasts seconds). The preparer does it
between saves instead: the first save sets aside room for the ``fast_keep_last + 1``
checkpoints the tier holds at once, and every save after it finds its memory ready.

It allocates and populates in 64 MiB steps (``STEP_BYTES``) and rests twice as long as
each step took (:meth:`SlabPreparer.rest`): short calls with gaps fit in the slack of the
program's launch queue. The page-locking stays one call per slab (``host_map``: a copy may
not cross two registrations). A thread that waits for the slab in hand (a save's copier)
ends the rests (:meth:`SlabPreparer.hurry`), and so does one that waits for the whole
preparation (``join(hurry=True)``: ``prepare(wait=True)`` at set-up): nobody waits for a rest.

It never raises: a slab it cannot prepare (a full tmpfs) is logged and left to the save
that takes it, which then meets the error itself and raises it where the program sees it;
the slabs after it are left too (slabs are wanted lowest first, the order saves take them).

>>> done = []
>>> prep = SlabPreparer(done.append)
>>> prep.want([0, 1]); prep.join(); done
[0, 1]
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from gpusnap.device import outside_graph_captures
from gpusnap.thread_priority import lower_this_thread

__all__ = ["REST_FACTOR", "STEP_BYTES", "SlabPreparer"]

log = logging.getLogger("gpusnap")

STEP_BYTES = 64 << 20  # allocated and populated per call
REST_FACTOR = 2.0  # rest after a step, in multiples of the step's time (busy a third of the time)


class SlabPreparer:
    """Runs ``prepare(slab)`` for each wanted slab, in the order wanted, on one daemon thread
    (started when there is work, gone when there is none)."""

    def __init__(self, prepare: Callable[[int], Any]) -> None:
        self._prepare = prepare
        self._lock = threading.Lock()
        self._todo: list[int] = []
        self._thread: threading.Thread | None = None
        self._current: int | None = None  # the slab in hand
        self._stopped = False
        self._hurry = threading.Event()  # someone waits for the slab in hand: no more rests
        self._joining = 0  # threads in join(hurry=True): no rests at all meanwhile
        # "slab N: why" for each slab whose last preparation failed (one line per slab: each
        # save wants a failing slab again)
        self.errors: list[str] = []
        self.prepared = 0  # slabs it prepared

    def want(self, slabs: Iterable[int]) -> None:
        with self._lock:
            if self._stopped:
                return
            self._todo.extend(s for s in slabs if s not in self._todo and s != self._current)
            if self._todo and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gpusnap-slab-prep", daemon=True)
                self._thread.start()

    def made(self, slab: int) -> None:
        """``slab`` is ready (whoever made it): its error line, if any, goes."""
        head = f"slab {slab}: "
        with self._lock:
            self.errors = [e for e in self.errors if not e.startswith(head)]

    def on_own_thread(self) -> bool:
        """Whether the caller is this preparer's thread (whose slabs are made with rests)."""
        with self._lock:
            return self._thread is not None and self._thread is threading.current_thread()

    def rest(self, busy_s: float) -> None:
        """The preparer's pause after a step that took ``busy_s``: ``REST_FACTOR`` times as
        long, cut short by :meth:`hurry` or :meth:`stop`; none while a join hurries it."""
        if not self._joining:
            self._hurry.wait(REST_FACTOR * busy_s)

    def hurry(self) -> None:
        """A thread waits for the slab in hand: finish it without rests."""
        self._hurry.set()

    def busy(self) -> bool:
        with self._lock:
            return self._thread is not None

    def join(self, timeout: float | None = None, *, hurry: bool = False) -> None:
        """Wait for the work wanted so far; ``hurry``: without rests meanwhile (the caller
        waits for it, so nothing is gained by pacing)."""
        counted = False
        try:
            with self._lock:
                thread = self._thread
                self._joining, counted = self._joining + hurry, hurry
            if hurry:
                self._hurry.set()
            if thread is not None:
                thread.join(timeout)
        finally:
            if counted:
                with self._lock:
                    self._joining -= 1

    def stop(self) -> None:
        """Prepare nothing more; returns at once (the slab in hand is finished, and its
        owner, told it is closed, lets it go: ``FastTier.slab_memory``). Never waits: it
        runs from ``close()``, which a garbage collection may call on any thread, the
        preparer's own or one holding what the slab in hand needs."""
        with self._lock:
            self._stopped = True
            self._todo.clear()
        self._hurry.set()

    def _run(self) -> None:
        try:
            self._prepare_all()
        finally:  # (an interrupt included: a later want() starts a new thread)
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = self._current = None

    def _prepare_all(self) -> None:
        lower_this_thread()  # the kernel's page work, at the lowest priority (thread_priority.py)
        outside_graph_captures()  # page-locking while the program captures a graph must not break it
        while True:
            with self._lock:
                self._current = None
                if not self._todo:  # (ends under the lock: a want() from now on starts a thread)
                    self._thread = None
                    return
                slab = self._current = self._todo.pop(0)
                if not self._stopped and not self._joining:
                    self._hurry.clear()  # (a new slab: nobody waits for it yet)
            head = f"slab {slab}: "
            failed_before = any(e.startswith(head) for e in self.errors)
            try:
                self._prepare(slab)
                self.prepared += 1
                self.made(slab)
            except Exception as exc:  # noqa: BLE001 (the save that takes this slab meets it again)
                if not failed_before:  # (said once)
                    log.warning("gpusnap: could not prepare fast-tier slab %d ahead of use: %s", slab, exc)
                with self._lock:
                    self.errors = [*(e for e in self.errors if not e.startswith(head)), head + str(exc)]
                    # the slabs after it wait for the next save's want(): made now (space freed
                    # meanwhile), a later one would take the room this one, needed sooner, lacks
                    self._todo.clear()
