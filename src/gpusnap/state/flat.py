"""What a flatten produces and what it can store: :class:`StorageSpan`, :class:`FlatState`,
:class:`FlatPlan` (see :mod:`gpusnap.state.flatten` for how they are made), the
:class:`Stateful` protocol and :func:`tensor_problem`."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..errors import CheckpointError
from .plain import type_name

if TYPE_CHECKING:
    from .walker import _MapShape

__all__ = [
    "FlatPlan",
    "FlatState",
    "Stateful",
    "StorageSpan",
    "is_stateful",
    "shrunk_storage_error",
    "tensor_extent",
    "tensor_problem",
]


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()`` (optimizers, schedulers, RNGState)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


def is_stateful(value: object) -> bool:
    """True for instances with callable ``state_dict`` and ``load_state_dict`` (not classes)."""
    if isinstance(value, type):
        return False
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


@dataclass(slots=True, eq=False)  # not frozen: save() builds one per storage, frozen init is slow
class StorageSpan:
    """The bytes ``[start, end)`` of one storage covered by the tensors of ``app_state``.

    ``tensors`` keeps the storage alive (and its memory out of the allocator's hands) for as
    long as the span is referenced; ``paths`` names every tensor on it, for error messages
    (read only: the spans of saves laid out alike share it, as their trees share nodes).
    """

    index: int
    storage: torch.UntypedStorage
    device: torch.device
    start: int
    end: int
    tensors: list[torch.Tensor] = field(repr=False)
    paths: list[str]

    @property
    def nbytes(self) -> int:
        """Length of the span in bytes (0 when only empty tensors use the storage)."""
        return self.end - self.start

    def release(self) -> None:
        """Let go of the storage and its tensors (the save is done with them): whatever still
        holds this span (a finished window, a thread's last job) no longer keeps the
        program's memory alive. The span's byte range stays, for its records."""
        self.storage = _RELEASED
        self.tensors = []

    def as_bytes(self) -> torch.Tensor:
        """A uint8 tensor on the storage's device aliasing exactly the span (no copy).

        CheckpointError when the storage no longer holds the span (the program shrank or
        freed it: ``untyped_storage().resize_(0)``, as FSDP does): ``set_`` would silently
        grow the program's storage back, with uninitialized bytes."""
        have = self.storage.nbytes()
        if have < self.end:
            raise shrunk_storage_error(self.paths, self.end, have)
        # new_empty on a per-device template: ~1.5 us less than torch.empty(device=...) per
        # span, paid for every span of every save
        template = _uint8_templates.get(self.device)
        if template is None:
            template = _uint8_templates[self.device] = torch.empty((0,), dtype=torch.uint8, device=self.device)
        return template.new_empty(0).set_(self.storage, self.start, (self.nbytes,), (1,))


@dataclass(slots=True, eq=False)
class _Replay:
    """How to walk a state laid out as the plan says, learnt by the walks that match it (a
    plan's memo: none of its layouts depend on it)."""

    # app_state's type and shape, as the last walk given the plan found them; None until then
    # (a walk without a plan notes no shapes: they would cost the first save up to ~10%)
    root: tuple[type, _MapShape] | None = None
    # Nodes a walk along ``root`` makes again, shared by the trees of such walks: by (first
    # leaf, shape), the node of a container of tensors only (a state_dict, an optimizer's
    # state), made of the plan's nodes; by shape, (the items, the node) of a list or tuple of
    # scalars (an optimizer's param indices). One per container of ``root``; emptied when
    # ``root`` changes
    made: dict[Any, Any] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class FlatPlan:
    """What a walk worked out, keyed by the tensors' layouts (see the module docstring). Holds
    no tensor and no storage (``refs`` are weak: nothing is kept alive by a plan). The
    per-leaf lists are columns, in walk order, compared a whole list at a time."""

    types: list[type]
    attrs: list[tuple[torch.Size, torch.dtype, torch.device, bool]]  # shape, dtype, device, requires_grad
    offsets: list[int]  # storage offsets
    strides: list[tuple[int, ...]]
    nbytes: list[int]  # the storage's size
    nodes: list[dict[str, Any]]  # per tensor leaf: its finished tree node (shared by the trees of planned walks)
    spans: list[list[int]]  # per span: its leaves
    shared: list[int]  # the spans of more than one leaf
    refs: list[weakref.ref[torch.Tensor]]  # per leaf, the tensor checked supported then (weak: kept alive by none)
    paths: list[str]  # per leaf, its path then
    named: list[list[str]]  # per span, the paths of its leaves then (shared by the spans of planned walks)
    firsts: list[int]  # per span, its first leaf
    devices: list[torch.device]  # per span: its storage's device
    starts: list[int]  # per span: its bytes [start, end)
    ends: list[int]
    replay: _Replay = field(default_factory=_Replay)


@dataclass(frozen=True)
class FlatState:
    """The manifest tree of ``app_state`` (``{"t": "dict", ...}``) and its storage spans;
    ``plan`` speeds up the next ``flatten`` of a state laid out the same way. The tree (and
    each span's ``paths``) shares objects with the plan and other results of it: read only."""

    tree: dict[str, Any]
    spans: list[StorageSpan]
    plan: FlatPlan | None = None
    planned: bool = False  # whether this walk reused the plan it was given


def tensor_extent(tensor: torch.Tensor) -> tuple[int, int] | None:
    """Byte range ``[first, end)`` of ``tensor`` within its storage; None when it is empty."""
    numel = tensor.numel()
    if numel == 0:
        return None
    item = tensor.element_size()
    first = tensor.storage_offset()
    if tensor.is_contiguous():  # the common case, without a Python loop over dimensions
        return first * item, (first + numel) * item
    last = first + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    return first * item, (last + 1) * item


def shrunk_storage_error(paths: list[str], needed: int, have: int) -> CheckpointError:
    """The error for a storage that holds fewer bytes than the tensors on it need."""
    shown = ", ".join(paths[:3]) + (f" (+{len(paths) - 3} more)" if len(paths) > 3 else "") if paths else "a tensor"
    freed = "was freed" if have == 0 else f"was shrunk to {have} bytes"
    return CheckpointError(
        f"{shown}: the tensor's storage {freed}, but the tensor reaches byte {needed} of it "
        "(untyped_storage().resize_(), as FSDP does to unsharded parameters): its bytes are gone, "
        "so they cannot be checkpointed. Save the state while its storages are allocated (FSDP: "
        "the sharded parameters of model.state_dict()), or leave this tensor out of app_state"
    )


_uint8_templates: dict[torch.device, torch.Tensor] = {}
_RELEASED = torch.UntypedStorage(0)  # what a released span points at: no bytes


def tensor_problem(tensor: torch.Tensor) -> str | None:
    """Why gpusnap cannot copy ``tensor``'s bytes, or None when it can."""
    if (
        type(tensor) in (torch.Tensor, nn.Parameter)
        and tensor.layout == torch.strided
        and not (tensor.is_quantized or tensor.is_nested or tensor.is_meta or tensor.is_conj() or tensor.is_neg())
        and tensor.device.type in ("cpu", "cuda")
    ):
        return None  # the common case, decided in one expression (storage access checked in add)
    if isinstance(tensor, nn.parameter.UninitializedTensorMixin):
        return "an uninitialized lazy parameter/buffer; run a forward pass first"
    if type(tensor) not in (torch.Tensor, nn.Parameter):
        return f"tensor subclass {type_name(tensor)} (only torch.Tensor and nn.Parameter are supported)"
    if tensor.is_quantized:
        return f"quantized tensor ({tensor.dtype}); dequantize it or store int_repr() and its scales"
    if tensor.is_nested:
        return "nested tensor"
    if tensor.layout != torch.strided:
        return f"layout {tensor.layout} (only strided tensors; convert with .to_dense())"
    if tensor.is_meta:
        return "meta tensor (it has no data)"
    if tensor.is_conj() or tensor.is_neg():
        return "lazy conjugate/negative view; call .resolve_conj()/.resolve_neg() first"
    try:
        tensor.untyped_storage()
    except Exception as exc:  # functional wrappers, fake tensors: no real storage
        return f"it has no accessible storage ({exc})"
    return None
