"""The lazy-restore gate: no op touches a target before its bytes are back.

``GateMode`` is a dispatch mode on the thread that called ``restore(lazy=True)``. For each
ATen op it looks at every tensor argument; one whose storage is a target of a span not yet
loaded makes the op wait for exactly that span, which moves to the head of the loader's
queue. Reads and writes are treated alike: a write must land after the restored bytes, or
the loader would overwrite it. On CUDA the op's stream then waits for the span's copy event,
so the wait costs the CPU nothing once the copy is queued.

Launches the dispatcher never sees (CUDA graph replays, hand-launched Triton, compiled
graphs; ``launch_hooks``) and higher-order ops (whose inner ops run below the mode) wait for
every span. Once everything is loaded the mode passes every op through untouched until it is
popped, on its own thread, at the next gpusnap call there (``LazyRestore.reap``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpusnap import launch_hooks
from gpusnap.capture.schema import tensor_args
from gpusnap.restore.schedule import LoadSpan, Schedule, SpanState
from gpusnap.state.apply import RestorePlan

__all__ = ["Gate", "GateMode", "needs_dynamo"]


def needs_dynamo() -> bool:
    """Whether the mode's first op will import torch._dynamo (the fallback wrapper)."""
    return not _HIDDEN


class Gate:
    """Which storages are gated, and the waiting itself; thread-safe (autograd threads)."""

    def __init__(self, schedule: Schedule, plan: RestorePlan, started: float) -> None:
        self.schedule = schedule
        self.started = started
        self.complete = False  # every copy has run: nothing left to gate
        self.waits = 0
        self.wait_s = 0.0
        self.opaque_waits = 0
        self._lock = threading.Lock()
        self._synced: set[tuple[int, int]] = set()  # (span, stream) pairs already ordered after the copy
        self._by_storage: dict[int, list[LoadSpan]] = {}
        for ls in schedule.spans:
            for target in plan.targets(ls.index):
                spans = self._by_storage.setdefault(target.untyped_storage()._cdata, [])
                if ls not in spans:
                    spans.append(ls)

    def before_op(self, tensors: Iterable[torch.Tensor]) -> None:
        by_storage = self._by_storage
        for t in tensors:
            try:
                key = t.untyped_storage()._cdata
            except (RuntimeError, NotImplementedError):  # sparse, nested...: no storage of ours
                continue
            spans = by_storage.get(key)
            if spans is not None:
                for ls in spans:
                    self.need(ls)

    def need(self, ls: LoadSpan) -> None:
        """Return once the current stream may use ``ls``'s targets (raises if it never may)."""
        if ls.first_needed is None:
            ls.first_needed = time.perf_counter()
        if ls.state is not SpanState.LOADED:
            with self._lock:
                self.waits += 1
            waited = self.schedule.wait(ls)
            with self._lock:
                self.wait_s += waited
        if ls.ready and not self.complete and not launch_hooks.capturing():
            # (inside a CUDA graph capture nothing runs now, and a capturing stream may not
            # wait on an event from outside it: the capture began after every span was
            # loaded, and its replays wait through before_opaque_launch)
            self._order_after(ls)

    def before_opaque_launch(self) -> None:
        """A ``launch_hooks`` listener: a launch the gate cannot see is about to run."""
        if not self.complete:
            self.need_all()

    def need_all(self) -> None:
        """For a launch that may touch anything: every span loaded, the stream after every copy."""
        if self.complete:
            return
        with self._lock:
            self.opaque_waits += 1
        waited = self.schedule.wait_all()
        with self._lock:
            self.wait_s += waited
        if launch_hooks.capturing():
            return  # see need(): nothing runs inside a capture; its replays order themselves
        for ls in self.schedule.spans:
            if ls.ready:
                self._order_after(ls)

    def _order_after(self, ls: LoadSpan) -> None:
        for device, event in ls.ready:
            stream = torch.cuda.current_stream(device)
            key = (ls.index, stream.cuda_stream)
            if key not in self._synced:
                stream.wait_event(event)
                with self._lock:
                    self._synced.add(key)

    def first_needed(self, plan: RestorePlan) -> dict[str, float]:
        """Key path -> seconds from restore() to the program's first touch of it."""
        out: dict[str, float] = {}
        for ls in self.schedule.spans:
            if ls.first_needed is not None:
                for path in plan.span_paths.get(ls.index, []):
                    out[path] = ls.first_needed - self.started
        return out


def _dispatch(self: GateMode, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
    kwargs = kwargs or {}
    gate = self.gate
    if not gate.complete:
        if isinstance(func, torch._ops.HigherOrderOperator):
            gate.need_all()  # its subgraph's ops run below this mode, unseen
        else:
            gate.before_op(tensor_args(args, kwargs))
    return func(*args, **kwargs)


def _hide_from_dynamo(fn: Any) -> bool:
    """Mark ``fn`` so that TorchDynamo never compiles it, nor anything it calls.

    torch protects every dispatch mode's handler the same way, but through a wrapper whose
    first call imports torch._dynamo: about a second, paid by the program's first op after a
    lazy restore, i.e. by a cold start's first forward. Marking the code object directly needs
    only torch's C extension. False (torch then wraps as usual) where that API is missing.
    """
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )
    except ImportError:
        return False
    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    return True


_HIDDEN = _hide_from_dynamo(_dispatch)


class GateMode(TorchDispatchMode):
    """Dispatch mode that holds each op until the targets it touches are restored."""

    supports_higher_order_operators = True
    __torch_dispatch__ = _dispatch

    def __init__(self, gate: Gate) -> None:
        super().__init__()
        self.gate = gate

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # compiled code stays compiled; its launches are gated through launch_hooks

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return not _HIDDEN  # already hidden: no wrapper, no torch._dynamo import
