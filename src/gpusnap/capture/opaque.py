"""Launches the dispatcher never sees: CUDA graph replays and hand-launched Triton kernels.

While any window is open, each such launch is treated as writing every pending buffer
(``CaptureWindow.protect_all``): conservative, and correct. The patches are installed once,
at class level, and cost one check of an empty list when no window is open.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

from gpusnap.capture.window import CaptureWindow

__all__ = ["install_hooks", "open_windows"]

_windows: list[CaptureWindow] = []
_lock = threading.Lock()


class open_windows:
    """Registers a window with the opaque-launch hooks for its lifetime."""

    @staticmethod
    def add(window: CaptureWindow) -> None:
        install_hooks()
        with _lock:
            _windows.append(window)

    @staticmethod
    def remove(window: CaptureWindow) -> None:
        with _lock:
            if window in _windows:
                _windows.remove(window)


def _protect_everything() -> None:
    if not _windows:
        return
    with _lock:
        windows = [w for w in _windows if not w.closed]
    for w in windows:
        w.protect_all()


def _wrap(owner: Any, name: str) -> None:
    original = getattr(owner, name)
    if getattr(original, "__gpusnap_wrapped__", False):
        return

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _protect_everything()
        return original(*args, **kwargs)

    wrapper.__gpusnap_wrapped__ = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


_TARGETS = (
    # (module, attribute path): each wrapped once its module has been imported by the program
    ("torch.cuda", "CUDAGraph.replay"),
    ("triton.runtime.jit", "JITFunction.run"),
    ("torch._inductor.output_code", "CompiledFxGraph.__call__"),
)


def install_hooks() -> None:
    """Wrap every opaque launcher whose module is loaded (cheap; re-checked per window).

    Covered: ``torch.cuda.CUDAGraph.replay`` (graphs, make_graphed_callables, cudagraph
    trees), Triton's ``JITFunction.run`` (hand-launched kernels), and inductor's
    ``CompiledFxGraph.__call__`` (torch.compile'd graphs, whose kernels the tracker cannot
    see because it keeps compiled code compiled).
    """
    for module_name, path in _TARGETS:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        owner_name, attr = path.rsplit(".", 1)
        owner = getattr(module, owner_name, None)
        if owner is not None and hasattr(owner, attr):
            _wrap(owner, attr)
