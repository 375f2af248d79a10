"""Doors: ways of reaching a tensor's bytes that the lazy-restore gate, a dispatch mode on one
thread, never sees.

The gate sees the ATen ops of the thread that called ``restore(lazy=True)`` (and of the
autograd threads that carry its mode stack). These reach memory without an ATen op the gate
holds (measured on torch 2.13: most reach no dispatch mode at all; on any other thread none
is held):

- C code reading the bytes or handing out their address: ``Tensor.tolist``, ``numpy`` and
  ``__array__`` (``np.asarray``), ``__dlpack__`` and ``torch.to_dlpack``,
  ``__cuda_array_interface__``, ``data_ptr`` (safetensors, ctypes, extensions); on a storage
  ``data_ptr`` (``torch.save`` of a storage), ``tolist`` and ``__iter__``;
- ``__repr__`` and ``__format__`` (``print``, ``str``, f-strings): torch formats below every
  dispatch mode;
- ``__reduce_ex__`` (``pickle``, ``torch.save``, ``copy.copy``) and ``__deepcopy__`` (also
  ``nn.Parameter``'s, whose ``clone`` is an ATen op on whatever thread copies), and a
  storage's ``__reduce__`` and ``__deepcopy__``.

Each door is replaced on its class by a wrapper that first makes the calling thread wait for
its tensor's (or storage's) spans in every live gate (``restore.active``), then calls the original; on CUDA
the thread's current stream is ordered after the copies, as for an op. Any thread waits,
except gpusnap's own (named ``gpusnap-...``: the loader must never wait for itself).

One door is not about a tensor: ``torch._C._InferenceMode.__exit__``, which the exit of every
``torch.inference_mode()`` block and ``@torch.inference_mode()`` function calls when it runs
(a ``with`` statement binds its manager's ``__exit__`` on entry, so the Python class's own
would not do for a block entered before the restore). Leaving the guard puts back the
dispatch keys it found, which drops the gate's Python key if the gate was pushed inside it
(``inference_mode(False)`` nested in inference mode; a restore called inside inference mode
is not lazy at all, ``gate.lazy_refusal``); on the way out the keys are given back if this
thread holds a gate. A ``with torch._C._InferenceMode(...)`` block entered before the
restore exits without this door: ``LazyRestore.reap`` detects that at the next gpusnap call.

Installed with the first live gate and removed with the last (invariant 5: at rest nothing
is wrapped). ATen ops on threads no gate covers are not intercepted (``nn.Module.__call__``
is not wrapped either: TorchDynamo compares it with the original and would trace a
wrapper); see docs/restore.md, "Threads".
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.dlpack
from torch import nn

__all__ = ["DOORS", "DoorHooks", "exempt", "install", "installed", "uninstall"]

# (class, attribute) replaced by a wrapper that waits for the tensor it is called on
TENSOR_DOORS: tuple[tuple[type, str], ...] = (
    (torch.Tensor, "tolist"),
    (torch.Tensor, "numpy"),
    (torch.Tensor, "__array__"),
    (torch.Tensor, "__dlpack__"),
    (torch.Tensor, "__cuda_array_interface__"),
    (torch.Tensor, "data_ptr"),
    (torch.Tensor, "__repr__"),
    (torch.Tensor, "__format__"),
    (torch.Tensor, "__reduce_ex__"),
    (torch.Tensor, "__deepcopy__"),
    (nn.Parameter, "__deepcopy__"),
)
# (class, attribute) replaced by a wrapper that waits for the storage it is called on. Not
# Tensor.untyped_storage itself: torch asks for a tensor's storage to learn its identity
# (TorchDynamo's fake tensors, compiling while the restore loads), not to read it.
STORAGE_DOORS: tuple[tuple[type, str], ...] = (
    (torch.UntypedStorage, "data_ptr"),
    (torch.UntypedStorage, "tolist"),
    (torch.UntypedStorage, "__iter__"),
    (torch.UntypedStorage, "__reduce__"),
    (torch.UntypedStorage, "__deepcopy__"),
)
# (module, function) taking the tensor first
FUNCTION_DOORS: tuple[tuple[Any, str], ...] = ((torch, "to_dlpack"), (torch.utils.dlpack, "to_dlpack"))
EXIT_DOOR = (torch._C._InferenceMode, "__exit__")
DOORS = TENSOR_DOORS + STORAGE_DOORS + FUNCTION_DOORS + (EXIT_DOOR,)


@dataclass(frozen=True)
class DoorHooks:
    """What the wrappers call (``restore.active`` provides them, for every live gate)."""

    wait_for: Callable[[torch.Tensor], None]  # the tensor's spans loaded, this stream after their copies
    wait_for_storage: Callable[[torch.UntypedStorage], None]  # the same for a storage
    rearm: Callable[[], None]  # a guard just exited: this thread's gate keeps its dispatch keys


@dataclass(frozen=True)
class _Installed:
    owner: Any  # class or module
    name: str
    own: bool  # the attribute was in the owner's own __dict__ (else inherited: deleted again)
    original: Any
    wrapper: Any


_installed: list[_Installed] = []
_lock = threading.Lock()


def exempt() -> bool:
    """gpusnap's own threads never wait at a door (the loader's threads would wait for themselves)."""
    return threading.current_thread().name.startswith("gpusnap-")


def installed() -> bool:
    return bool(_installed)


def install(hooks: DoorHooks) -> None:
    """Wrap every door (nothing if they are wrapped already)."""
    with _lock:
        if _installed:
            return
        for owner, name in TENSOR_DOORS:
            _wrap(owner, name, _tensor_door(hooks.wait_for))
        for owner, name in STORAGE_DOORS:
            _wrap(owner, name, _tensor_door(hooks.wait_for_storage))
        for owner, name in FUNCTION_DOORS:
            _wrap(owner, name, _function_door(hooks))
        _wrap(*EXIT_DOOR, _exit_door(hooks))


def uninstall() -> None:
    """Put every original back; a name someone re-bound meanwhile is left as it is."""
    with _lock:
        while _installed:
            done = _installed.pop()
            if vars(done.owner).get(done.name) is not done.wrapper:
                continue
            if done.own:
                setattr(done.owner, done.name, done.original)
            else:
                delattr(done.owner, done.name)


def _wrap(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    namespace = vars(owner)
    own = name in namespace
    original = namespace[name] if own else getattr(owner, name, None)
    if original is None:  # (an older torch without it)
        return
    wrapper = make(original)
    setattr(owner, name, wrapper)
    _installed.append(_Installed(owner, name, own, original, wrapper))


def _tensor_door(wait_for: Callable[[Any], None]) -> Callable[[Any], Any]:
    """Wrappers of methods (and properties) of a tensor or storage: ``wait_for(self)`` first."""

    def make(original: Any) -> Any:
        if isinstance(original, property):  # __cuda_array_interface__
            getter = original.fget
            assert getter is not None

            def get(self: Any) -> Any:
                wait_for(self)
                return getter(self)

            return property(functools.wraps(getter)(get), original.fset, original.fdel, original.__doc__)

        @functools.wraps(original)
        def door(self: Any, *args: Any, **kwargs: Any) -> Any:
            wait_for(self)
            return original(self, *args, **kwargs)

        return door

    return make


def _function_door(hooks: DoorHooks) -> Callable[[Any], Any]:
    wait_for = hooks.wait_for

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def door(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensor, torch.Tensor):
                wait_for(tensor)
            return original(tensor, *args, **kwargs)

        return door

    return make


def _exit_door(hooks: DoorHooks) -> Callable[[Any], Any]:
    rearm = hooks.rearm

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def __exit__(self: Any, *exc: Any) -> Any:
            try:
                return original(self, *exc)
            finally:
                rearm()

        return __exit__

    return make
