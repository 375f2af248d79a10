"""One lazy restore: the loader in the background, the gate on the calling thread, the handle.

Call order (all on the thread that called ``restore(lazy=True)``, the *owner*)::

    session = LazyRestore(loader, plan, handle, done, started)
    session.begin()    # gate pushed, loader started, spans finish() reads loaded, finish() run
    ...                # the program runs; ops wait only for the spans they touch
    session.reap()     # at any later gpusnap call: pops the gate once everything is loaded

``begin`` returns as soon as plain values are back and Stateful objects are loaded, which
needs only the spans ``RestorePlan.read_at_finish`` names (RNG state, module extra state;
not optimizer state, whose ``load_state_dict`` keeps the tensor objects).

If the load fails after ``begin`` returned, the gate stays: an op touching a span that was
never loaded raises the error (on every thread the gate sees), and so does the handle. The
next restore on the same Checkpointer retires the failed session.

Every session is registered process-wide (``restore.active``) from ``begin`` until it is over:
saves of any Checkpointer wait for it, and the doors (``restore.lazy.doors``) gate the reads no ATen
op shows, on any thread, while its gate is live. A fork waits for it too (:meth:`quiesce`): a
forked child has none of its threads (``fork_safety``).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

from torch.utils._python_dispatch import _get_current_dispatch_mode, _get_current_dispatch_mode_stack

from gpusnap import launch_hooks
from gpusnap.errors import CheckpointError
from gpusnap.handles import RestoreCompletion, RestoreHandle
from gpusnap.restore import active
from gpusnap.restore.lazy.gate import Gate, GateMode, needs_dynamo, python_key_included, rearm_dispatch_keys
from gpusnap.restore.pipeline.loader import Loader
from gpusnap.restore.pipeline.schedule import SpanState
from gpusnap.state.plan import RestorePlan

__all__ = ["LazyRestore", "pop_gate"]

log = logging.getLogger("gpusnap")


def _warm_dynamo() -> None:
    """Import ``torch._dynamo`` off the critical path when the gate's first op would.

    Only where the gate could not be hidden from TorchDynamo directly (``gate.needs_dynamo``):
    then torch's wrapper imports torch._dynamo (about a second) on the mode's first op;
    started here, the import overlaps the loading.
    """
    if needs_dynamo() and "torch._dynamo" not in sys.modules:
        threading.Thread(target=__import__, args=("torch._dynamo",), name="gpusnap-warmup", daemon=True).start()


def pop_gate(mode: GateMode, owner: int) -> bool:
    """Pop ``mode`` if this is its thread and it is the top mode there (a mode pushed later
    must go first); True if popped. A gate left on the stack only passes ops through."""
    if threading.get_ident() != owner or _get_current_dispatch_mode() is not mode:
        return False
    mode.__exit__(None, None, None)
    return True


class LazyRestore:
    """The state of one ``restore(lazy=True)``; see the module docstring for the call order."""

    def __init__(self, loader: Loader, plan: RestorePlan, handle: RestoreHandle, done: RestoreCompletion,
                 started: float) -> None:
        self.loader = loader
        self.plan = plan
        plan.versioned_writes = False  # ops record their inputs' versions before the gate waits
        loader.prepare()  # before the gate exists: its aliases would wait for their own spans
        self._done = done
        self.handle = handle
        self.started = started
        self.gate = Gate(loader.schedule, plan, started)
        loader.schedule.check = self.gate.unseen_write  # a write the gate never saw fails the load
        self.mode = GateMode(self.gate)
        self.owner = threading.get_ident()
        self.popped = False
        self.retired = False
        self._lock = threading.Lock()
        self._returned = False  # begin() is over: the handle may complete
        self._outcome: list[BaseException | None] = []  # the loader's result, once known
        self._settled = False  # the handle is complete
        self._over = threading.Event()  # settled (or begin() raised): what a save waits for
        self._reported = threading.Event()  # _on_done has run: the copy thread holds no lock of ours
        self.dropped = 0  # times the gate was found without its dispatch key on its thread
        loader.on_done = self._on_done

    # -- owner thread --------------------------------------------------------------------------
    def begin(self) -> None:
        """Start loading and return once ``finish()`` has run; raises (loading stopped) on failure."""
        _warm_dynamo()
        self.mode.__enter__()
        # A graph capture cannot wait for copies on the capturing thread: load everything first
        launch_hooks.add_listener(self.gate.before_opaque_launch, on_capture=self.gate.need_all)
        active.begin(self)
        try:
            self.loader.start()
            spans = self.loader.schedule.spans
            for index in sorted(self.plan.read_at_finish):
                self.loader.schedule.wait(spans[index])
            self.plan.finish()  # under the gate: what load_state_dict touches waits for it
        except BaseException as exc:
            self.loader.schedule.fail(exc)
            self.loader.join()
            self.retire()
            self._over.set()  # restore() raises: the program knows its targets are not restored
            raise
        self.handle.stats["return_s"] = time.perf_counter() - self.started
        with self._lock:
            self._returned = True
        self._settle()

    def reap(self) -> bool:
        """Pop the gate if loading is over and it is this thread's top mode; True once popped."""
        if not self.popped and threading.get_ident() == self.owner and self._lost_key():
            self._report_lost_key()
        if not self.popped and (self.gate.complete or self.retired):
            self.popped = pop_gate(self.mode, self.owner)
        return self.popped

    def rearm(self) -> None:
        """On a thread whose mode stack holds this gate, still gating: give the stack back the
        dispatch keys a guard's exit dropped (``restore.lazy.doors``, the inference-mode door)."""
        if not self.gate.complete and self.mode in _get_current_dispatch_mode_stack():
            rearm_dispatch_keys()

    def _lost_key(self) -> bool:
        return self.mode in _get_current_dispatch_mode_stack() and not python_key_included()

    def _report_lost_key(self) -> None:
        """A guard that puts back the dispatch keys it found (``torch._C._InferenceMode`` used
        directly, a C++ guard) exited on this thread after restore(): ops since then passed
        the gate unseen. Nothing can tell which; say so, and gate again from now on."""
        self.dropped += 1
        self.handle.stats["gate_dropped"] = self.dropped
        log.warning(
            "gpusnap: the lazy restore of %s found its gate without its dispatch key on the thread that "
            "called restore(lazy=True): a guard entered before the restore (such as torch._C._InferenceMode) "
            "exited since, and ops run meanwhile may have read tensors not yet loaded. Call "
            "restore(lazy=True) outside such guards, or handle.wait() before leaving them",
            self.handle.checkpoint_id,
        )
        rearm_dispatch_keys()

    def retire(self) -> None:
        """Stop gating (a later restore takes over, or begin() failed) and pop where possible."""
        self.retired = True
        self.gate.complete = True
        launch_hooks.remove_listener(self.gate.before_opaque_launch)
        active.end(self)
        self.reap()

    # -- any thread ----------------------------------------------------------------------------
    def done(self) -> bool:
        return self.loader.done()

    def wait(self, timeout: float | None = None) -> None:
        """Until the load is over; raises its error."""
        self.loader.wait(timeout)

    def over(self) -> bool:
        """Whether the load is over and what the targets hold is known (``restore.active``)."""
        return self._over.is_set()

    def wait_over(self) -> None:
        self.loader.join()
        self._over.wait()

    # -- around a fork (fork_safety; restore.active calls these) ---------------------------------
    def quiet(self) -> bool:
        """Whether a fork now leaves this restore nothing to wait for in the child: it is over;
        or this thread is inside ``begin()`` (``finish()`` forked) and the load is over: the
        child's copy of this thread then finishes ``begin()`` itself."""
        if self._over.is_set():
            return True
        return self._inside_begin() and self._reported.is_set()

    def quiesce(self) -> None:
        """Before a fork, on the forking thread: until :meth:`quiet` (bounded by the load only)."""
        if self._inside_begin():
            self.loader.join()
            self._reported.wait()
        else:
            self.wait_over()

    def _inside_begin(self) -> bool:
        return threading.get_ident() == self.owner and not self._returned

    def after_fork_in_child(self) -> None:
        """In a forked child: what the parent's threads may have held at the fork is new; a
        load the fork did not wait for (:func:`restore.active.quiesce_for_fork`) fails here,
        so that no op, door or wait of the child waits for a loader it lacks."""
        self._lock = threading.Lock()
        self.gate.after_fork_in_child()
        self.loader.schedule.cond = threading.Condition()
        if self.loader.done():
            if not self._reported.is_set():  # the copy thread was between the two at the fork
                self._on_done(self.loader.error)
            return
        self.loader._close(CheckpointError(
            "this process was forked while the lazy restore was loading, without waiting for it (from one of "
            "gpusnap's own threads, which never wait, or the wait was interrupted): the tensors it had not loaded "
            "yet cannot be loaded here; restore again in this process, or fork from a program thread (the fork "
            "then waits for the load)"
        ))

    def _on_done(self, error: BaseException | None) -> None:
        """On the copy thread, after every copy has run."""
        if error is None:
            self.gate.complete = True
            launch_hooks.remove_listener(self.gate.before_opaque_launch)
            active.gate_done(self)
        with self._lock:
            self._outcome.append(error)
        self._reported.set()
        self._settle()

    def refresh(self) -> None:
        """Bring the handle's stats up to date: a wait still finishing on the program side may
        end after the loader reported."""
        if self._settled:
            self.handle.stats.update(self.stats())

    def _settle(self) -> None:
        """Complete the handle once both the load is over and ``begin`` has returned."""
        with self._lock:
            if not (self._returned and self._outcome) or self._settled:
                return
            self._settled = True
            error = self._outcome[0]
            self.handle.stats.update(self.stats())
        try:
            self._record(error)
            if error is None:
                self._done.finish()
            else:
                self._done.fail(error)
        finally:
            self._over.set()  # saves may go on

    def _record(self, error: BaseException | None) -> None:
        """Tell ``restore.active`` what the targets hold now: the restored bytes, or (after a
        failure) stale ones where a span was never loaded."""
        spans = self.loader.schedule.spans
        plan = self.plan
        if error is None:
            active.settled(self, restored_targets=[t for ls in spans for t in plan.targets(ls.index)],
                           stale_targets=(), error=None)
            return
        stale = [(t, ", ".join(plan.span_paths.get(ls.index, ())) or f"storage #{ls.index}")
                 for ls in spans if ls.state is not SpanState.LOADED for t in plan.targets(ls.index)]
        active.settled(self, restored_targets=(), stale_targets=stale, error=error)

    def stats(self) -> dict[str, Any]:
        loader, gate = self.loader, self.gate
        end = loader.finished if loader.finished is not None else time.perf_counter()
        return {
            **loader.stats.as_dict(),
            "total_s": max(end - self.started, self.handle.stats.get("return_s", 0.0)),
            "waits": gate.waits,
            "wait_s": gate.wait_s,
            "opaque_waits": gate.opaque_waits,
            "gate_dropped": self.dropped,
            "first_needed": gate.first_needed(self.plan),
        }
