"""Giving a storage other memory while every tensor object on it stays as it is.

A suspended storage is *parked*: its data pointer is exchanged
(``UntypedStorage._swap_data_ptr_``) with that of a storage made over its bytes' host copy
(``torch._C._construct_storage_from_data_pointer``, which owns nothing), and the storage that
now holds the device memory is dropped, which frees it. Resuming exchanges the pointer again
with a new device allocation holding the bytes. Tensors keep their StorageImpl, so views
keep viewing, tied weights stay tied, Parameters stay Parameters (``requires_grad``,
``grad``, optimizer state keyed by them), and no version counter moves.

Why not ``storage.resize_(0)``, which frees the memory too: every tensor on the storage then
still has its shape over no memory, and an op that touches one reads address 0 (measured on
torch 2.13: a segmentation fault on CPU for ``t + 1``, ``t.sum()``, ``t.clone()``, ``repr(t)``;
an illegal address on CUDA, which ends the process's CUDA context). A parked storage points
at valid memory instead: on CPU at the host copy itself, on CUDA at the page-locked host copy
mapped into the device's address space (unified addressing), so a kernel that touches a
suspended tensor works, over the bus, and its writes are in the bytes resume brings back. A
parked storage is not resizable (its memory is not the allocator's): ``resize_`` raises.

The exchange swaps only pointers; :func:`exchange_all` does a list of them all or nothing.
Which exchange (``GPUSNAP_STORAGE_SWAP``): ``auto`` (the default) torch's method where it
has one (2.13 and later), else the same exchange in a small C++ helper compiled once per
torch build (``moving.compiled_swap``); ``native`` only torch's; ``compiled`` only the helper.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from gpusnap.moving import compiled_swap

__all__ = ["ENV", "MODES", "exchange_all", "host_alias", "missing_support"]

ENV = "GPUSNAP_STORAGE_SWAP"
MODES = ("auto", "native", "compiled")

Exchange = Callable[[torch.UntypedStorage, torch.UntypedStorage], None]


def missing_support() -> str | None:
    """Why this process cannot park storages, or None (in ``compiled`` mode, and in ``auto``
    on a torch before 2.13, the first call builds the helper if the cache lacks it)."""
    if not hasattr(torch._C, "_construct_storage_from_data_pointer"):
        return "this torch has no torch._C._construct_storage_from_data_pointer"
    try:
        _exchange()
    except RuntimeError as exc:
        return str(exc)
    return None


def host_alias(address: int, nbytes: int, device: torch.device) -> torch.UntypedStorage:
    """A storage on ``device`` over ``nbytes`` of host memory at ``address``, owning nothing:
    the caller keeps that memory alive as long as a storage points at it."""
    return torch._C._construct_storage_from_data_pointer(address, device, nbytes)  # type: ignore[return-value]


def exchange_all(pairs: Sequence[tuple[torch.UntypedStorage, torch.UntypedStorage]]) -> None:
    """Exchange the memory of each pair's storages (same device, same size); if one
    exchange fails, the ones done are undone before the error propagates."""
    exchange = _exchange()  # (chosen before any exchange: no exchange happens if none can)
    done: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
    try:
        for a, b in pairs:
            exchange(a, b)
            done.append((a, b))
    except BaseException:
        for a, b in reversed(done):
            exchange(a, b)
        raise


def _exchange() -> Exchange:
    """The exchange ``GPUSNAP_STORAGE_SWAP`` picks; RuntimeError saying why there is none."""
    mode = os.environ.get(ENV, "") or "auto"
    if mode not in MODES:
        raise RuntimeError(f"{ENV}={mode!r} is not one of {', '.join(MODES)}")
    native = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
    if mode == "native" or (mode == "auto" and native):
        if not native:
            raise RuntimeError(f"this torch has no UntypedStorage._swap_data_ptr_ (torch 2.13 has it) and {ENV}=native "
                               f"forbids the compiled helper (unset {ENV} to use it)")
        return _native
    failure = compiled_swap.why_not()
    if failure is not None:
        if mode == "auto":
            failure = f"this torch has no UntypedStorage._swap_data_ptr_ (torch 2.13 has it), and {failure}"
        raise RuntimeError(failure)
    return compiled_swap.exchange


def _native(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    a._swap_data_ptr_(b)  # type: ignore[attr-defined]
