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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["exchange_all", "host_alias", "missing_support"]


def missing_support() -> str | None:
    """Why this torch cannot park storages, or None."""
    if not hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
        return "this torch has no UntypedStorage._swap_data_ptr_ (torch 2.13 has it)"
    if not hasattr(torch._C, "_construct_storage_from_data_pointer"):
        return "this torch has no torch._C._construct_storage_from_data_pointer"
    return None


def host_alias(address: int, nbytes: int, device: torch.device) -> torch.UntypedStorage:
    """A storage on ``device`` over ``nbytes`` of host memory at ``address``, owning nothing:
    the caller keeps that memory alive as long as a storage points at it."""
    return torch._C._construct_storage_from_data_pointer(address, device, nbytes)  # type: ignore[return-value]


def exchange_all(pairs: Sequence[tuple[torch.UntypedStorage, torch.UntypedStorage]]) -> None:
    """Exchange the memory of each pair's storages (same device, same size); if one
    exchange fails, the ones done are undone before the error propagates."""
    done: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
    try:
        for a, b in pairs:
            a._swap_data_ptr_(b)  # type: ignore[attr-defined]
            done.append((a, b))
    except BaseException:
        for a, b in reversed(done):
            a._swap_data_ptr_(b)  # type: ignore[attr-defined]
        raise
