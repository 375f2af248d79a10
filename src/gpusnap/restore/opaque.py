"""Launches the dispatcher never sees wait for every lazy restore in progress.

A CUDA graph replay, a hand-launched Triton kernel or an inductor-compiled graph may read or
write any target, and its kernels do not pass through the gate's dispatch mode. While a lazy
restore is loading, each such launch (on any thread: the hooks are class-level) first waits
until every span is loaded and orders the launching stream after every copy.

These wrappers sit beside the capture layer's (``capture.opaque``): each layer wraps the same
launchers once, under its own marker, and the two chain in either order (``functools.wraps``
copies the inner wrapper's markers onto the outer one). With no restore in progress a
wrapper costs one check of an empty list.

A launcher module imported only after the restore began (the first ``torch.compile`` call
imports inductor; a program may import Triton late) is wrapped as soon as its import
finishes: while a restore is loading, an import hook on ``sys.meta_path`` watches for it.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from gpusnap.restore.gate import Gate

__all__ = ["active_gates", "install_hooks"]

_gates: list[Gate] = []
_lock = threading.Lock()
_MARK = "__gpusnap_restore_wrapped__"
_TARGETS = (
    # (module, attribute path): wrapped once the program has imported the module
    ("torch.cuda", "CUDAGraph.replay"),
    ("triton.runtime.jit", "JITFunction.run"),
    ("torch._inductor.output_code", "CompiledFxGraph.__call__"),
)


class active_gates:
    """Registers a lazy restore's gate with the hooks while it loads."""

    @staticmethod
    def add(gate: Gate) -> None:
        with _lock:
            _gates.append(gate)
            if _WATCHER not in sys.meta_path:
                sys.meta_path.insert(0, _WATCHER)
        install_hooks()

    @staticmethod
    def remove(gate: Gate) -> None:
        with _lock:
            if gate in _gates:
                _gates.remove(gate)
            if not _gates and _WATCHER in sys.meta_path:
                sys.meta_path.remove(_WATCHER)


def _wait_for_everything() -> None:
    if not _gates:
        return
    with _lock:
        gates = [g for g in _gates if not g.complete]
    for gate in gates:
        gate.need_all()


def _wrap(owner: Any, name: str) -> None:
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _wait_for_everything()
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
    """Wrap every opaque launcher whose module is loaded (cheap; re-checked per restore)."""
    for module_name, path in _TARGETS:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        owner_name, attr = path.rsplit(".", 1)
        owner = getattr(module, owner_name, None)
        if owner is not None and hasattr(owner, attr):
            _wrap(owner, attr)
