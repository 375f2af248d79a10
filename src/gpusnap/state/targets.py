"""The typed results of a restore plan: what the manifest says of a span (:class:`SpanInfo`),
where a tensor's bytes lie in it (:class:`TensorSpec`), and what each span fills
(:class:`SpanTarget`, :class:`ByteTarget`); with the checks and allocations of one target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .flatten import tensor_problem
from .plain import dtype_name

__all__ = ["ByteTarget", "SpanInfo", "SpanTarget", "TensorSpec", "allocate", "byte_contiguous", "device_here",
           "target_problem"]


@dataclass(frozen=True)
class SpanInfo:
    """What the manifest says about one stored span: its length and the device it came from."""

    nbytes: int
    device: str


@dataclass(frozen=True)
class TensorSpec:
    """A checked ``tensor`` node: where a tensor's bytes lie in its stored span."""

    storage: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    byte_offset: int
    device: str
    requires_grad: bool

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def extent(self) -> int:
        """Bytes from the first to past the last element (0 when empty)."""
        if self.numel == 0:
            return 0
        return (sum((n - 1) * s for n, s in zip(self.shape, self.stride)) + 1) * self.itemsize

    def describe(self) -> str:
        return f"shape {list(self.shape)} dtype {dtype_name(self.dtype)}"


@dataclass(frozen=True)
class SpanTarget:
    """Fill ``target`` from the bytes of span ``spec.storage``; a *box copy* (resharding,
    state/reshard.py) fills ``target[dst]`` from ``stored[src]`` only (it needs the whole span)."""

    target: torch.Tensor
    spec: TensorSpec
    path: str
    src: tuple[slice, ...] | None = None
    dst: tuple[slice, ...] | None = None

    def writable(self, versioned: bool) -> torch.Tensor:
        """``target``'s memory, through an alias that shares its autograd version counter
        (``detach``) or not (``.data``: the write is invisible to autograd's in-place checks)."""
        return self.target.detach() if versioned else self.target.data


@dataclass(frozen=True, slots=True)
class ByteTarget:
    """A target of a :meth:`RestorePlan.streamable` span: bytes ``[start, stop)`` of the span
    are ``dst`` (a flat ``uint8`` alias of the target's memory); ``inference``: the target is
    an inference tensor (written under inference mode); ``path`` names it for errors."""

    start: int
    stop: int
    dst: torch.Tensor
    inference: bool
    path: str



def target_problem(target: torch.Tensor, spec: TensorSpec) -> str | None:
    """Why ``target`` cannot take the checkpoint's tensor in place, or None."""
    if target.shape != spec.shape or target.dtype != spec.dtype:
        return (
            f"the checkpoint has {spec.describe()}, the target has "
            f"shape {list(target.shape)} dtype {dtype_name(target.dtype)}"
        )
    problem = tensor_problem(target)
    if problem is not None:
        hint = "; materialize it first (e.g. module.to_empty(device=...))" if target.is_meta else ""
        return f"the target cannot be written in place: {problem}{hint}"
    return None


def allocate(spec: TensorSpec) -> torch.Tensor:
    """A new tensor for ``spec`` on its recorded device if this machine has it, else on CPU."""
    device = device_here(spec.device)
    if spec.numel and _dense(spec.shape, spec.stride):
        tensor = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=device)
    else:  # overlapping or gapped layouts cannot be allocated as such; contiguous holds the values
        tensor = torch.empty(spec.shape, dtype=spec.dtype, device=device)
    if spec.requires_grad and (spec.dtype.is_floating_point or spec.dtype.is_complex):
        tensor.requires_grad_(True)
    return tensor


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Non-overlapping and without gaps (a permutation of a contiguous layout)."""
    expected = 1
    for step, size in sorted((s, n) for n, s in zip(shape, stride) if n != 1):
        if step != expected:
            return False
        expected *= size
    return True


def device_here(name: str) -> torch.device:
    """``name`` if this machine has that device, else the CPU."""
    try:
        device = torch.device(name)
    except RuntimeError:
        return torch.device("cpu")
    if device.type == "cpu":
        return device
    backend: Any = getattr(torch, device.type, None)
    try:
        ok = bool(backend.is_available()) and (device.index is None or device.index < backend.device_count())
    except Exception:  # a backend without these functions: treat it as absent
        ok = False
    return device if ok else torch.device("cpu")


def byte_contiguous(target: torch.Tensor, spec: TensorSpec) -> bool:
    """Target and stored layout are both row-major contiguous: byte ``i`` maps to byte ``i``."""
    if spec.numel == 0:
        return True
    expected = 1
    for n, s in reversed(list(zip(spec.shape, spec.stride))):
        if n != 1 and s != expected:
            return False
        expected *= n
    return target.is_contiguous()
