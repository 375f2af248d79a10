"""Launches the dispatcher never sees: CUDA graph replays, hand-launched Triton kernels and
inductor-compiled graphs.

Their kernels do not pass through any dispatch mode, so the layers that rely on one (a
capture window's tracker, a lazy restore's gate) register a *listener* here while they are
active: a callable run before every such launch, on the launching thread, which makes the
launch safe (the capture protects every pending buffer; the restore waits for every span).

gpusnap's own kernels (the chunk hashes a capture or a restore enqueues from its threads) are
launched inside :func:`internal` and do not count: a capture treating its own hash kernels as
program launches would protect every buffer once per copied piece.

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

__all__ = ["add_listener", "install_hooks", "internal", "remove_listener"]

Listener = Callable[[], None]

_listeners: list[Listener] = []
_lock = threading.Lock()
_MARK = "__gpusnap_wrapped__"
_TARGETS = (
    # (module, attribute path): wrapped once the program has imported the module
    ("torch.cuda", "CUDAGraph.replay"),
    ("triton.runtime.jit", "JITFunction.run"),
    ("torch._inductor.output_code", "CompiledFxGraph.__call__"),
)


def add_listener(listener: Listener) -> None:
    """Run ``listener()`` before every opaque launch until :func:`remove_listener`."""
    with _lock:
        _listeners.append(listener)
        if _WATCHER not in sys.meta_path:
            sys.meta_path.insert(0, _WATCHER)
    install_hooks()


def remove_listener(listener: Listener) -> None:
    """Stop calling ``listener`` (compared with ``==``: a bound method again is fine)."""
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)
        if not _listeners and _WATCHER in sys.meta_path:
            sys.meta_path.remove(_WATCHER)


_own = threading.local()  # depth of internal() on this thread


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
    if not _listeners or getattr(_own, "depth", 0):
        return
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        listener()


def _wrap(owner: Any, name: str) -> None:
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return

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


_WATCHED = frozenset(module for module, _ in _TARGETS)
_WATCHER = _ImportWatcher()


def install_hooks() -> None:
    """Wrap every opaque launcher whose module is loaded (cheap; re-checked per listener)."""
    for module_name, path in _TARGETS:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        owner_name, attr = path.rsplit(".", 1)
        owner = getattr(module, owner_name, None)
        if owner is not None and hasattr(owner, attr):
            _wrap(owner, attr)
