"""The tracker: a dispatch mode installed on the saving thread only while a window is open.

For each ATen op it derives the buffers written (``schema.written_tensors``), protects the
pending ones before the op runs (copy-on-write or wait), logs which window buffers the op
touched when the window asks for it (the DAG log: the access order that lazy restore loads
in; the first window of a Checkpointer logs it, later ones reuse it, because reading every
op's arguments in Python is the tracker's main cost), and notes the program's own
host<->device copies so that the copier yields to them. It declares
``ignore_compile_internals`` so that compiled code stays compiled (a plain mode turns every
compiled function it sees back into eager code for good: docs/notes/dispatcher-research.md
section 4); compiled regions are therefore opaque to it (see docs/capture.md). Device ops
recorded into a CUDA graph capture are let through untouched: they run at the replay, which
the launch hooks report. Writes to host tensors during a capture run at once and are tracked.
Higher-order ops (``torch.cond``, ``while_loop``, ``map``, eager ``flex_attention``) run code
below the mode that it does not see: each is treated as an opaque launch (every buffer
protected). A written tensor without a storage of its own (sparse layouts) protects its
indices' and values' storages, or everything when they cannot be named.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from gpusnap.capture.schema import tensor_args, writes_nothing, written_tensors
from gpusnap.capture.window import CaptureWindow, bookkeeping_error
from gpusnap.device import waitable_event
from gpusnap.launch_hooks import capturing

__all__ = ["TrackerMode"]

_aten = torch.ops.aten
_COPIES = {_aten.copy_.default, _aten._to_copy.default}


def _crosses_host(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> torch.device | None:
    """The CUDA device of a host<->device copy, or None."""
    if func not in _COPIES:
        return None
    src = args[1] if func is _aten.copy_.default else args[0]
    dst = args[0] if func is _aten.copy_.default else out
    if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor):
        return None
    kinds = {src.device.type, dst.device.type}
    if kinds == {"cpu", "cuda"}:
        return src.device if src.device.type == "cuda" else dst.device
    return None


class TrackerMode(TorchDispatchMode):
    """Pass-through mode that keeps the window's captured state consistent.

    gpusnap's work for an op never makes the op fail: an exception in it fails the save
    instead (``CaptureWindow.guarded``), and the op runs as the program asked."""

    # Higher-order ops (torch.cond, while_loop, map, eager flex_attention) come here too,
    # instead of failing with "no rule registered" under the mode
    supports_higher_order_operators = True

    def __init__(self, window: CaptureWindow) -> None:
        super().__init__()
        self.window = window

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        window = self.window
        if window.closed:
            return func(*args, **kwargs)
        try:
            # Hot path (most ops): nothing written and no read log wanted: one dict lookup.
            if not isinstance(func, OpOverload):  # a higher-order op: opaque work
                if not capturing():
                    _opaque(window, func)
            elif window.log_reads or not writes_nothing(func):
                _track(window, func, args, kwargs)
            else:
                window.stats.ops_seen += 1
        except Exception as exc:
            window.fail(bookkeeping_error(_name(func), exc))
        except BaseException as exc:  # an interrupt: it reaches the program; the save fails
            window.fail(bookkeeping_error(_name(func), exc))
            raise
        out = func(*args, **kwargs)
        if func in _COPIES and not capturing():
            window.guarded(lambda: _note_program_copy(window, func, args, kwargs, out), func.__name__)
        return out


def _track(window: CaptureWindow, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if capturing():
        # Recorded into a CUDA graph, not run (its replay is an opaque launch), except
        # writes to host tensors, which run now like any other
        host = [t for t in written_tensors(func, args, kwargs) if t.device.type == "cpu"]
        if host:
            window.touch((), host, func.__name__)
        return
    written = written_tensors(func, args, kwargs)
    reads = tensor_args(args, kwargs) if window.log_reads else ()
    window.touch(reads, written, func.__name__)


def _opaque(window: CaptureWindow, func: Any) -> None:
    """A higher-order op runs code the tracker does not see (its branches and bodies run
    below this mode), and may close over any tensor: it may write every buffer."""
    window.stats.ops_seen += 1
    window.protect_all()


def _note_program_copy(window: CaptureWindow, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
    device = _crosses_host(func, args, kwargs, out)
    if device is not None:
        event = waitable_event()
        event.record(torch.cuda.current_stream(device))
        window.program_copy(event)


def _name(func: Any) -> str:
    return str(getattr(func, "__name__", None) or func)
