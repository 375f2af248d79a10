"""Which tensors of an export share a storage with an earlier one (tied weights, views):
formats that store each tensor on its own (safetensors, DCP) write those as copies."""

from __future__ import annotations

import torch

__all__ = ["shared_with"]


def shared_with(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """``name -> the first name on the same storage``, for every tensor but the first of each."""
    owners: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, tensor in tensors.items():
        storage = tensor.untyped_storage()
        if not storage.nbytes():  # (empty storages may all sit at address 0)
            continue
        owner = owners.setdefault(storage.data_ptr(), name)
        if owner != name:
            out[name] = owner
    return out
