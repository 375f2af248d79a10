"""``resume(lazy=True)``: the program runs at once; an op waits only for the storages it
touches, which jump the queue.

This is the lazy restore's gate (``restore.lazy.gate``), fed by a copy thread instead of a
checkpoint loader: each suspended storage is one span of a :class:`Schedule`; the thread
takes spans in the state's order (a model's parameters in registration order, roughly the
order a forward pass needs them), the gate's ``urgent`` requests first, copies each from the
host copy into memory allocated for it by ``resume()`` itself, exchanges the storage's
pointer (``moving.swap``) and marks the span loaded. On CUDA the copy runs on a gpusnap
stream, which first waits for the work the program had enqueued before ``resume()``; a span
is loaded once its copy is *enqueued*, and the gate makes the op's stream wait (on the
device) for the copy's event. On CPU the copies are plain copies on the thread.

The session registers with ``restore.active`` as a lazy restore does, so the same
protections hold: every save of any Checkpointer waits for it (it would otherwise capture
bytes still on their way), the *doors* (``tolist``, ``repr``, ``numpy``, DLPack...) wait on
any thread, a fork waits, and inductor-compiled graphs, Triton launches and CUDA graph
replays (``launch_hooks``) wait for everything.

What differs from a lazy restore: until its span is loaded a storage still points at the
host copy, which holds the right bytes. So a failed resume loses nothing: the storages not
brought back stay suspended (and working), and ``resume()`` may be called again. A write the
gate could not see (another thread, an op under ``no_dispatch``) before a storage's pointer
is exchanged is caught by its version counter: that storage is left suspended, with the
write in it, and the resume fails naming it.

Call order, on the thread that called ``resume(lazy=True)`` (the *owner*)::

    session = LazyResume(core, members, buffers, slab, started)
    session.begin()     # gate pushed, copy thread started
    ...                 # the program runs
    session.reap()      # at a later gpusnap call on that thread: pops the gate once done
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from gpusnap import launch_hooks
from gpusnap.capture.swap_guard import before_swap
from gpusnap.device import outside_graph_captures, own_stream
from gpusnap.errors import CheckpointError
from gpusnap.moving.copies import bytes_of, host_part
from gpusnap.moving.device_memory import give_back
from gpusnap.moving.host_memory import Slab
from gpusnap.moving.members import Member
from gpusnap.moving.swap import exchange_all
from gpusnap.restore import active
from gpusnap.restore.lazy.gate import Gate, GateMode, python_key_included, rearm_dispatch_keys
from gpusnap.restore.lazy.lazy_restore import pop_gate
from gpusnap.restore.pipeline.schedule import LoadSpan, Schedule

log = logging.getLogger("gpusnap")

__all__ = ["LazyResume", "reap_finished"]

Done = Callable[[list[int], "BaseException | None", float, int], None]  # (indices back, error, end, waits)
_sessions: set[LazyResume] = set()  # gates not popped yet (held: only their own thread can pop them)
_sessions_lock = threading.Lock()


def reap_finished() -> None:
    """Pop, on this thread, the gates of lazy resumes that are over (any gpusnap call)."""
    with _sessions_lock:
        sessions = list(_sessions)
    for session in sessions:
        if session.reap():
            with _sessions_lock:
                _sessions.discard(session)


class _Targets:
    """What the gate asks a restore plan for: the tensors on each span's storage (their
    version counters catch writes the gate did not see) and key paths for its messages."""

    def __init__(self, members: Sequence[Member]) -> None:
        self.span_paths = {i: list(m.paths) for i, m in enumerate(members)}
        self._targets: list[list[torch.Tensor]] = []
        for m in members:
            live = [t for t in (ref() for ref in m.tensors) if t is not None and t.untyped_storage()._cdata == m.storage._cdata]
            # (none left: a tensor over the storage still keys it for the gate)
            self._targets.append(live or [bytes_of(m.storage)])

    def targets(self, index: int) -> list[torch.Tensor]:
        return self._targets[index]


class LazyResume:
    """One ``resume(lazy=True)``; see the module docstring."""

    def __init__(self, members: Sequence[Member], buffers: Sequence[torch.Tensor], slab: Slab, started: float,
                 on_done: Done) -> None:
        self.members = list(members)
        self.buffers = list(buffers)
        self.slab = slab
        self.on_done = on_done
        spans = [LoadSpan(i, m.nbytes, 1, False, frozenset({m.device})) for i, m in enumerate(self.members)]
        self.schedule = Schedule(spans, range(len(spans)), chunk_size=max((m.nbytes for m in self.members), default=1),
                                 piece_chunks=1)
        self.gate = Gate(self.schedule, _Targets(self.members), started)  # type: ignore[arg-type]
        self.mode = GateMode(self.gate)
        self.owner = threading.get_ident()
        self.popped = False
        self.error: BaseException | None = None
        self.back: list[int] = []  # indices of the members brought back, in order
        self._over = threading.Event()
        self._starts: dict[torch.device, torch.cuda.Event] = {}
        self._thread = threading.Thread(target=self._run, name="gpusnap-resume", daemon=True)

    # -- owner thread --------------------------------------------------------------------------
    def begin(self) -> None:
        for device in dict.fromkeys(m.device for m in self.members):
            if device.type == "cuda":  # the copies follow what the program enqueued before resume()
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                self._starts[device] = event
        self.mode.__enter__()
        launch_hooks.add_listener(self.gate.before_opaque_launch, on_capture=self.gate.need_all)
        active.begin(self)  # type: ignore[arg-type]
        active.track(self)
        with _sessions_lock:
            _sessions.add(self)
        self._thread.start()

    def reap(self) -> bool:
        """Pop the gate if the resume is over and this is its thread; True once popped."""
        if not self.popped and self._over.is_set():
            self.popped = pop_gate(self.mode, self.owner)
        return self.popped

    # -- any thread ----------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> None:
        """Until the resume is over (TimeoutError after ``timeout`` seconds)."""
        if not self._over.wait(timeout):
            raise TimeoutError(f"the lazy resume is still copying after {timeout} s")

    def over(self) -> bool:
        return self._over.is_set()

    def wait_over(self) -> None:
        self._over.wait()

    # -- what restore.active asks of a session -------------------------------------------------
    def quiet(self) -> bool:
        return self._over.is_set()

    def quiesce(self) -> None:
        self._over.wait()

    def rearm(self) -> None:
        """A guard's exit dropped the dispatch keys on a thread whose stack holds this gate."""
        if not self.gate.complete and not python_key_included():
            rearm_dispatch_keys()

    def after_fork_in_child(self) -> None:
        """A forked child has no copy thread: what it had not brought back stays suspended."""
        self.gate.after_fork_in_child()
        self.schedule.cond = threading.Condition()
        if not self._over.is_set():
            error = CheckpointError("this process was forked while a lazy resume was copying: the storages it had not "
                                    "brought back stay suspended in the child")
            self.schedule.fail(error)
            self.schedule.close(error)
            self.gate.complete = True
            self.error = error
            self._over.set()

    # -- copy thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        error: BaseException | None = None
        streams: dict[torch.device, torch.cuda.Stream] = {}
        try:
            if self._starts:
                outside_graph_captures()
            while (piece := self.schedule.take()) is not None:
                self._bring_back(piece.span, streams)
            # Every copy done: the host copy is read by no one any more (the copies waited for
            # the program's work enqueued before resume(); later ops touching a storage waited
            # for its exchange, so they use the device memory)
            for stream in streams.values():
                stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 (reported through wait() and the waiting ops)
            error = exc
            self.schedule.fail(exc)
        self.schedule.close(error)
        self._finish(error)

    def _bring_back(self, ls: LoadSpan, streams: dict[torch.device, torch.cuda.Stream]) -> None:
        m, buffer = self.members[ls.index], self.buffers[ls.index]
        source = host_part(self.slab, m)
        ready: tuple[tuple[torch.device, torch.cuda.Event], ...] = ()
        if m.device.type == "cuda":
            stream = streams.get(m.device)
            if stream is None:
                stream = streams[m.device] = own_stream(m.device)
                stream.wait_event(self._starts[m.device])
            buffer.record_stream(stream)  # (freed later on the program's stream: after this copy)
            with torch.cuda.stream(stream):
                buffer.copy_(source, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            ready = ((m.device, event),)
        else:
            buffer.copy_(source)
        problem = self.gate.unseen_write(ls)
        if problem is not None:
            raise problem
        before_swap([m.storage])
        exchange_all([(m.storage, buffer.untyped_storage())])
        self.back.append(ls.index)
        self.schedule.mark_loaded(ls, ready)

    def _finish(self, error: BaseException | None) -> None:
        self.error = error
        self.gate.complete = True  # ops pass: what is not back still works from the host copy
        launch_hooks.remove_listener(self.gate.before_opaque_launch)
        # (off the active lists before over() turns true: active.retire_failed never sees
        # this session over and still live)
        active.end(self)  # type: ignore[arg-type]
        try:
            self.on_done(list(self.back), error, time.perf_counter(), self.gate.waits)
        finally:
            self.buffers.clear()
            try:
                if error is not None:  # (what was not brought back sits in the state's own pool: see copies.allocate)
                    give_back({m.device for m in self.members})
            except Exception as exc:  # (a sticky CUDA error: over() must still turn true)
                log.warning("gpusnap: after a failed lazy resume, giving its device memory back failed: %r", exc)
            finally:
                self._over.set()
