"""How an entry function declares the model a pool process builds ahead and warms up:
:func:`entry`, a decorator; and how the pool names it (``module:function``) and a process
finds it again.

>>> import torch
>>> @entry(build=lambda: torch.nn.Linear(4, 2))
... def serve(ready):
...     return ready.model(torch.ones(1, 4)).tolist()
>>> spec_of(serve).warm_up is None
True
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

__all__ = ["EntrySpec", "entry", "entry_name", "load_entry", "spec_of"]

F = TypeVar("F", bound=Callable[..., Any])
_ATTR = "__gpusnap_pool_entry__"
_NAME = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


@dataclass(frozen=True)
class EntrySpec:
    """What a pool process does before it is asked for a checkpoint: ``build()`` the model
    (under ``gpusnap.empty_model``: parameters uninitialised, buffers real, ties kept), then
    ``warm_up(model)`` once under ``torch.no_grad()``."""

    build: Callable[[], nn.Module]
    warm_up: Callable[[Any], object] | None = None


def entry(*, build: Callable[[], nn.Module], warm_up: Callable[[Any], object] | None = None) -> Callable[[F], F]:
    """Declare the model a pool process builds ahead for the decorated entry function.

    ``build()`` returns the model as it serves (as for ``gpusnap.cold_start``); it runs in
    each pool process under ``gpusnap.empty_model``, on the pool's device, before any
    checkpoint is asked for. ``warm_up(model)``, if given, then runs one forward of the
    serving shapes (its result is dropped; the weights are zeros then), so that cuBLAS
    handles and kernels are loaded before the first request. It must leave nothing computed
    from the weights behind (a cache of them): the weights are restored in place after it.

    The decorated function ``serve(ready: gpusnap.pool.Ready)`` runs once the taken
    process's weights are in place; it serves for as long as it likes, and what it returns
    (JSON) is what ``PoolProcess.wait()`` reports.

    >>> prompt = torch.zeros(1, 128, dtype=torch.long, device="cuda")     # doctest: +SKIP
    >>> @gpusnap.pool.entry(build=lambda: GPT(cfg), warm_up=lambda m: m(prompt))  # doctest: +SKIP
    ... def serve(ready: gpusnap.pool.Ready) -> None:
    ...     run_http_server(ready.model)
    """
    if not callable(build):
        raise TypeError(f"entry(build=...) must be callable (returning the model), got {build!r}")
    if warm_up is not None and not callable(warm_up):
        raise TypeError(f"entry(warm_up=...) must be callable (taking the model) or None, got {warm_up!r}")
    spec = EntrySpec(build, warm_up)

    def declare(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"@gpusnap.pool.entry(...) decorates the entry function, not {fn!r}")
        setattr(fn, _ATTR, spec)
        return fn

    return declare


def spec_of(fn: Callable[..., Any]) -> EntrySpec:
    """The :class:`EntrySpec` ``fn`` was declared with; ``TypeError`` naming the fix if none."""
    spec = getattr(fn, _ATTR, None)
    if not isinstance(spec, EntrySpec):
        name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
        raise TypeError(f"{name} declares no model to build: decorate it with "
                        "@gpusnap.pool.entry(build=..., warm_up=...)")
    return spec


def entry_name(entry_fn: str | Callable[..., Any]) -> str:
    """``module:function`` for an entry given as that string or as the function itself;
    ``ValueError`` when a pool process could not import it by that name."""
    if isinstance(entry_fn, str):
        if not _NAME.match(entry_fn):
            raise ValueError(f"an entry is named module:function (such as my_server:serve), not {entry_fn!r}")
        return entry_fn
    if not callable(entry_fn):
        raise TypeError(f"entry must be a function or a 'module:function' string, got {entry_fn!r}")
    module, qualname = getattr(entry_fn, "__module__", None), getattr(entry_fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        raise ValueError(f"the pool's processes import the entry by name, and {qualname or entry_fn!r} of module "
                         f"{module!r} cannot be imported so: define it at the top level of a module of its own "
                         "(or pass 'module:function')")
    spec_of(entry_fn)  # (the mistake is this process's to report, before any process starts)
    return f"{module}:{qualname}"


def load_entry(name: str) -> tuple[Callable[..., Any], EntrySpec]:
    """Import ``module:function`` (in a pool process) and return it with its spec."""
    module_name, _, attr = name.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise AttributeError(f"module {module_name!r} has no {attr!r} (the entry {name})") from None
    if not callable(target):
        raise TypeError(f"the entry {name} is not a function: {target!r}")
    return target, spec_of(target)
