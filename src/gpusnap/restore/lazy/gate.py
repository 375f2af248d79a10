"""The lazy-restore gate: no op touches a target before its bytes are back.

``GateMode`` is a dispatch mode on the thread that called ``restore(lazy=True)``. For each
ATen op it looks at every tensor argument; one whose storage is a target of a span not yet
loaded makes the op wait for exactly that span, which moves to the head of the loader's
queue. Reads and writes are treated alike: a write must land after the restored bytes, or
the loader would overwrite it. On CUDA the op's stream then waits for the span's copy event,
so the wait costs the CPU nothing once the copy is queued.

Launches the dispatcher never sees (CUDA graph replays, hand-launched Triton, compiled
graphs; ``launch_hooks``) and higher-order ops (whose inner ops run below the mode) wait for
every span. Reads of memory that are no ATen op on the gated thread (``tolist``, ``repr``,
pickling, DLPack...: ``restore.lazy.doors``) wait through :meth:`Gate.before_op` too, on any
thread. Once everything is loaded the mode passes every op through untouched until it is
popped, on its own thread, at the next gpusnap call there (``LazyRestore.reap``).

A write the gate never saw (an op on another thread, or under ``no_dispatch``) changes its
target's version counter before the span is loaded; the loader then refuses to mark it
loaded (:meth:`Gate.unseen_write`): the restore fails naming the tensor instead of
overwriting the write or having computed on stale bytes. (The restore's own writes go
through ``.data`` aliases, which do not count; a gated write waits until the span is loaded.)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpusnap import launch_hooks
from gpusnap.capture.schema import tensor_args
from gpusnap.errors import CheckpointError
from gpusnap.restore.pipeline.schedule import LoadSpan, Schedule, SpanState
from gpusnap.state.plan import RestorePlan

__all__ = ["Gate", "GateMode", "lazy_refusal", "looking_past_failures", "needs_dynamo", "python_key_included",
           "rearm_dispatch_keys", "storage_key", "storage_of"]

# The C method itself: what the gate and ``restore.active`` look up is the StorageImpl the
# restore writes, never a door or a subclass's override.
_untyped_storage = torch._C.TensorBase.untyped_storage
_PYTHON_KEYS = (torch._C.DispatchKey.Python, torch._C.DispatchKey.PythonTLSSnapshot)


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """``t.untyped_storage()`` without passing a door; None without a storage."""
    try:
        return _untyped_storage(t)
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, wrapper subclasses
        return None


def storage_key(t: torch.Tensor) -> int | None:
    """The identity of ``t``'s StorageImpl (shared by its views); None without a storage."""
    storage = storage_of(t)
    return None if storage is None else storage._cdata


def lazy_refusal() -> str | None:
    """Why a gate pushed here could not hold (then the restore must not be lazy), or None.

    Inside ``torch.inference_mode()`` the mode would be pushed under a guard that, when it
    exits, puts back the dispatch keys it found: without the Python key every later op
    bypasses the gate (a PyTorch behaviour). Where dispatch modes are excluded
    (``no_dispatch``) the gate would see no op at all.
    """
    if torch.is_inference_mode_enabled():
        return ("called inside torch.inference_mode(): leaving it drops the gate's dispatch key, so later ops "
                "would not wait for their tensors; call restore(lazy=True) outside inference mode to keep it lazy")
    if torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.Python):
        return "called where dispatch modes are disabled (no_dispatch): the gate would see no op"
    return None


_looking = threading.local()


@contextlib.contextmanager
def looking_past_failures() -> Iterator[None]:
    """On this thread, ops and doors on spans a failed restore never loaded pass instead of
    raising: for ``restore.active``, which only looks at which storages a state holds."""
    _looking.on = True
    try:
        yield
    finally:
        _looking.on = False


def python_key_included() -> bool:
    """Whether this thread's ops reach its dispatch modes (a pushed mode includes the key)."""
    return torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.Python)


def rearm_dispatch_keys() -> None:
    """Include the dispatch keys a pushed mode needs, as pushing it did (a guard dropped them)."""
    if not python_key_included():
        for key in _PYTHON_KEYS:
            torch._C._dispatch_tls_set_dispatch_key_included(key, True)


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
        self._paths = plan.span_paths
        # span index -> (target, its version counter now); None: an inference tensor has none
        self._versions: dict[int, list[tuple[torch.Tensor, int | None]]] = {}
        for ls in schedule.spans:
            versions = self._versions[ls.index] = []
            for target in plan.targets(ls.index):
                spans = self._by_storage.setdefault(_untyped_storage(target)._cdata, [])
                if ls not in spans:
                    spans.append(ls)
                versions.append((target, _version(target)))

    def after_fork_in_child(self) -> None:
        """A new lock: a thread of the parent may have held this one at the fork."""
        self._lock = threading.Lock()

    def before_op(self, tensors: Iterable[torch.Tensor]) -> None:
        by_storage = self._by_storage
        for t in tensors:
            try:
                key = _untyped_storage(t)._cdata
            except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested...: no storage of ours
                continue
            spans = by_storage.get(key)
            if spans is not None:
                for ls in spans:
                    self.need(ls)

    def before_storage(self, storage: torch.UntypedStorage) -> None:
        """For a read of ``storage``'s bytes (``restore.lazy.doors``)."""
        for ls in self._by_storage.get(storage._cdata, ()):
            self.need(ls)

    def unseen_write(self, ls: LoadSpan) -> BaseException | None:
        """Called by the loader just before ``ls`` counts as loaded (``Schedule.check``): the
        error to fail the restore with if a target changed meanwhile without the gate seeing it."""
        for target, version in self._versions.get(ls.index, ()):
            if version is not None and _version(target) != version:
                paths = self._paths.get(ls.index) or [f"storage #{ls.index}"]
                return CheckpointError(
                    f"{', '.join(paths)} was written by an op the lazy restore's gate did not see (another thread, "
                    f"or where dispatch modes were off) before its restored bytes were in place: that write is "
                    f"lost or was computed on stale bytes. Only the thread that called restore(lazy=True) is "
                    f"gated: call handle.wait() before other threads use restored tensors"
                )
        return None

    def need(self, ls: LoadSpan) -> None:
        """Return once the current stream may use ``ls``'s targets (raises if it never may)."""
        if ls.first_needed is None:
            ls.first_needed = time.perf_counter()
        if ls.state is not SpanState.LOADED:
            with self._lock:
                self.waits += 1
            try:
                waited = self.schedule.wait(ls)
            except CheckpointError:
                if getattr(_looking, "on", False):
                    return
                raise
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
        try:
            waited = self.schedule.wait_all()
        except CheckpointError:
            if getattr(_looking, "on", False):
                return
            raise
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


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor: no version counter
        return None


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
