"""Launches the dispatcher never sees: CUDA graph replays, hand-launched Triton kernels and
inductor-compiled graphs.

Their kernels do not pass through any dispatch mode, so the layers that rely on one (a
capture window's tracker, a lazy restore's gate) register a *listener* here while they are
active: a callable run before every such launch, on the launching thread, which makes the
launch safe (the capture protects every pending buffer; the restore waits for every span).

gpusnap's own kernels (the chunk hashes a capture or a restore enqueues from its threads) are
launched inside :func:`internal` and do not count: a capture treating its own hash kernels as
program launches would protect every buffer once per copied piece.

A CUDA graph *capture* launches nothing: the ops and kernels inside it are recorded, and run
only at a replay. On the capturing thread, between ``CUDAGraph.capture_begin`` and
``capture_end`` (:func:`capturing`), launches are therefore not reported, and the dispatch
modes let ops through untouched (protecting or loading a buffer there would record the copy
into the program's graph instead of running it). A listener may also ask to run once before a
capture begins (``on_capture``: a lazy restore finishes loading, since the program's thread
cannot wait for a copy while it captures).

The launchers are wrapped once, at class level, under one marker; with no listener a
wrapper costs one check of an empty list. A launcher module imported only after a listener
registered (the first ``torch.compile`` call imports inductor; a program may import Triton
late) is wrapped as soon as its import finishes: while any listener is registered, an import
hook on ``sys.meta_path`` watches for it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

from gpusnap import fork_safety

__all__ = ["add_listener", "capturing", "install_hooks", "internal", "remove_listener"]

Listener = Callable[[], None]

_listeners: list[Listener] = []
_on_capture: dict[Listener, Listener] = {}  # listener -> what it runs before a capture begins
_lock = threading.Lock()
_MARK = "__gpusnap_wrapped__"
_TARGETS = (
    # (module, attribute path, kind): wrapped once the program has imported the module
    ("torch.cuda", "CUDAGraph.replay", "launch"),
    ("torch.cuda", "CUDAGraph.capture_begin", "capture_begin"),
    ("torch.cuda", "CUDAGraph.capture_end", "capture_end"),
    ("triton.runtime.jit", "JITFunction.run", "launch"),
    ("torch._inductor.output_code", "CompiledFxGraph.__call__", "launch"),
)


def add_listener(listener: Listener, *, on_capture: Listener | None = None) -> None:
    """Run ``listener()`` before every opaque launch until :func:`remove_listener`, and
    ``on_capture()`` (if given) before a CUDA graph capture begins."""
    with _lock:
        _listeners.append(listener)
        if on_capture is not None:
            _on_capture[listener] = on_capture
        if _WATCHER not in sys.meta_path:
            sys.meta_path.insert(0, _WATCHER)
    install_hooks()


def remove_listener(listener: Listener) -> None:
    """Stop calling ``listener`` (compared with ``==``: a bound method again is fine)."""
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)
        if listener not in _listeners:
            _on_capture.pop(listener, None)
        if not _listeners and _WATCHER in sys.meta_path:
            sys.meta_path.remove(_WATCHER)


_own = threading.local()  # depth of internal() and of graph captures on this thread


def capturing() -> bool:
    """Whether this thread is between ``capture_begin`` and ``capture_end`` of a CUDA graph
    (one captured through ``torch.cuda.CUDAGraph``, the class ``torch.cuda.graph`` and
    inductor's CUDA graph trees use); known once a listener has installed the hooks."""
    return getattr(_own, "captures", 0) > 0


@contextlib.contextmanager
def _capture_section() -> Iterator[None]:
    """Around ``capture_begin``: run the ``on_capture`` callbacks, then mark this thread as
    capturing (unmarked again if the capture fails to begin)."""
    if not getattr(_own, "depth", 0):
        with _lock:
            before = [_on_capture[l] for l in _listeners if l in _on_capture]
        for callback in before:
            callback()
    _own.captures = getattr(_own, "captures", 0) + 1
    try:
        yield
    except BaseException:
        _end_capture()
        raise


def _end_capture() -> None:
    _own.captures = max(0, getattr(_own, "captures", 0) - 1)  # a capture begun before the hook


@contextlib.contextmanager
def internal() -> Iterator[None]:
    """Launches on this thread inside the block are gpusnap's own: listeners are not told."""
    depth = getattr(_own, "depth", 0)
    _own.depth = depth + 1
    try:
        yield
    finally:
        _own.depth = depth


def _before_launch() -> None:
    if not _listeners or getattr(_own, "depth", 0) or capturing():
        return
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        listener()


def _wrap(owner: Any, name: str, kind: str) -> None:
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return

    if kind == "capture_begin":

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with _capture_section():
                return original(*args, **kwargs)

    elif kind == "capture_end":

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                _end_capture()

    else:

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            _before_launch()
            return original(*args, **kwargs)

    setattr(wrapper, _MARK, True)
    setattr(owner, name, wrapper)


class _ImportWatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of a launcher module to hook it once imported."""

    def __init__(self) -> None:
        self._local = threading.local()

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name not in _WATCHED or getattr(self._local, "busy", False):
            return None
        self._local.busy = True  # the other finders may import; do not watch ourselves
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._local.busy = False
        loader = spec.loader
        if loader is not None and hasattr(loader, "exec_module"):
            exec_module = loader.exec_module

            def exec_then_hook(module: ModuleType) -> None:
                exec_module(module)
                install_hooks()  # the import system put the module in sys.modules already

            loader.exec_module = exec_then_hook  # type: ignore[method-assign]
        return spec


_WATCHED = frozenset(module for module, _, _ in _TARGETS)
_WATCHER = _ImportWatcher()


def _new_lock_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork


fork_safety.at_fork(after_in_child=_new_lock_in_child)


def install_hooks() -> None:
    """Wrap every opaque launcher whose module is loaded (cheap; re-checked per listener)."""
    for module_name, path, kind in _TARGETS:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        owner_name, attr = path.rsplit(".", 1)
        owner = getattr(module, owner_name, None)
        if owner is not None and hasattr(owner, attr):
            _wrap(owner, attr, kind)
