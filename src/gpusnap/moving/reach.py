"""What ``suspend`` moves: every tensor reachable from ``app_state``, found by walking the
live objects (not their ``state_dict()``, which leaves out gradients, non-persistent buffers
and anything that is no module, optimizer or Stateful, such as a KV cache object).

Walked, each object once (a cycle or a shared object is seen once):
- tensors, and a leaf tensor's ``.grad``; a wrapper subclass (DTensor, a nested jagged
  tensor) through the inner tensors its ``__tensor_flatten__`` names;
- modules: every submodule's parameters and buffers (non-persistent ones too) and its other
  attributes (a cache held by a module);
- optimizers: their ``state`` and ``param_groups``;
- mappings, lists, tuples, sets, deques;
- other objects of types defined outside torch and the standard library (an HF
  ``DynamicCache`` and its layers): their ``__dict__`` and ``__slots__``.

Objects of torch's own other types (streams, generators, compiler internals, data loaders)
and of the standard library are not entered: they hold no state of the program's to move,
and some (TorchDynamo's) reach far. CUDA graphs met on the way are reported (``graphs``).
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from gpusnap.state.plain import join_path

__all__ = ["Reached", "reach"]


@dataclass(frozen=True)
class Reached:
    """The tensors met (each tensor object once, with the first key path it was met at) and
    the key paths of the CUDA graphs met."""

    tensors: tuple[tuple[str, torch.Tensor], ...]
    graphs: tuple[str, ...]


# Not entered: they hold no tensor of the program's state (or none worth a walk).
_LEAF_TYPES = (type(None), bool, int, float, complex, str, bytes, bytearray, memoryview, range, slice, type,
               torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format)
_SEQUENCES = (list, tuple, set, frozenset, deque)
# roots of the modules whose types are never entered (torch's other types are handled above
# or hold nothing to move; the standard library's and numpy's hold no tensors)
_CLOSED_ROOTS = frozenset({"torch", "numpy", "builtins"}) | frozenset(getattr(sys, "stdlib_module_names", ()))


def reach(app_state: Mapping[str, Any]) -> Reached:
    """Every tensor and CUDA graph reachable from ``app_state``, depth first, in the order
    the program's state lists them (a model's parameters in registration order)."""
    tensors: list[tuple[str, torch.Tensor]] = []
    graphs: list[str] = []
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("", app_state)]
    while stack:
        path, value = stack.pop()
        if id(value) in seen or isinstance(value, _LEAF_TYPES):
            continue
        seen.add(id(value))
        children: list[tuple[str, Any]] = []
        if isinstance(value, torch.Tensor):
            if is_traceable_wrapper_subclass(value):
                attrs, _ = value.__tensor_flatten__()  # type: ignore[attr-defined]
                children = [(f"{path}.{a}", getattr(value, a)) for a in attrs]
            else:
                tensors.append((path or "<root>", value))
                if value.is_leaf and value.grad is not None:  # (.grad of a non-leaf warns)
                    children = [(f"{path}.grad", value.grad)]
        elif _is_cuda_graph(value):
            graphs.append(path or "<root>")
        elif isinstance(value, nn.Module):
            children = _module_children(value, path, seen)
        elif isinstance(value, torch.optim.Optimizer):
            children = [(join_path(path, "state"), value.state), (join_path(path, "param_groups"), value.param_groups)]
        elif isinstance(value, Mapping):
            for i, (key, item) in enumerate(value.items()):
                label = key if isinstance(key, (str, int)) and not isinstance(key, bool) else f"#{i}"
                children.append((join_path(path, label), item))
                if isinstance(key, torch.Tensor):
                    children.append((join_path(path, f"#{i}.key"), key))
        elif isinstance(value, _SEQUENCES):
            children = [(join_path(path, i), item) for i, item in enumerate(value)]
        elif _enterable(value):
            children = [(join_path(path, name), item) for name, item in _attributes(value)]
        stack.extend(reversed(children))  # (popped in order)
    return Reached(tuple(tensors), tuple(graphs))


def _module_children(module: nn.Module, path: str, seen: set[int]) -> list[tuple[str, Any]]:
    """Parameters, buffers and other attributes of ``module`` and each of its submodules,
    named as ``named_parameters`` names them (``model/layers.0.weight``)."""
    children: list[tuple[str, Any]] = []
    internal = _module_internals()
    for prefix, sub in module.named_modules():
        seen.add(id(sub))
        dot = f"{prefix}." if prefix else ""
        for name, tensor in (*sub._parameters.items(), *sub._buffers.items()):
            if tensor is not None:
                children.append((join_path(path, dot + name), tensor))
        for name, item in vars(sub).items():
            if name not in internal:
                children.append((join_path(path, dot + name), item))
    return children


_internals: frozenset[str] = frozenset()


def _module_internals() -> frozenset[str]:
    """The attributes every ``nn.Module`` has (hooks, the parameter and module tables)."""
    global _internals
    if not _internals:
        _internals = frozenset(vars(nn.Module())) | {"_parameters", "_buffers", "_modules"}
    return _internals


def _is_cuda_graph(value: Any) -> bool:
    graph_type = getattr(torch.cuda, "CUDAGraph", None)
    return graph_type is not None and isinstance(value, graph_type)


def _enterable(value: Any) -> bool:
    module = getattr(type(value), "__module__", None) or "builtins"
    return module.partition(".")[0] not in _CLOSED_ROOTS


def _attributes(value: Any) -> list[tuple[str, Any]]:
    """``value``'s instance attributes: its ``__dict__`` and the slots of its classes."""
    found: list[tuple[str, Any]] = []
    try:
        found.extend(vars(value).items())
    except TypeError:  # no __dict__
        pass
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                found.append((name, getattr(value, name)))
    return found
