"""The safetensors format: one file of named tensors and a JSON header (``pip install
safetensors``). It holds tensors only, each on storage of its own, contiguous."""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import torch

from gpusnap.interop.errors import FormatError, reason
from gpusnap.interop.report import Written
from gpusnap.interop.sharing import shared_with

__all__ = ["check", "library", "read", "write"]


def library(path: str) -> ModuleType:
    try:
        import safetensors.torch
    except ImportError as exc:
        raise FormatError(f"{path}: the safetensors format needs the safetensors package: pip install safetensors") from exc
    return safetensors.torch


def write(names: dict[str, Any], path: str) -> Written:
    """Write the tensors of ``names`` to the file ``path``; plain values are skipped (reported).

    Tensors that share a storage (tied weights, views) are refused by safetensors: the first
    of each storage is written as it is, each other one as a copy of its own (reported)."""
    st = library(path)
    tensors = {n: v for n, v in names.items() if isinstance(v, torch.Tensor)}
    check(names, path)
    copies = shared_with(tensors)
    ready = {n: (t.clone() if n in copies else t).contiguous() for n, t in tensors.items()}
    st.save_file(ready, path, metadata={"format": "pt"})  # "pt": what transformers' from_pretrained expects
    return Written(skipped=tuple(n for n in names if n not in tensors), copies=tuple(copies.items()))


def check(names: dict[str, Any], path: str) -> None:
    """Refuse a dtype safetensors cannot hold (complex128, say), naming ``path``, before any
    byte is written."""
    st = library(path)
    tensors = {n: v for n, v in names.items() if isinstance(v, torch.Tensor)}
    for dtype in {t.dtype for t in tensors.values()}:
        try:
            st.save({"probe": torch.empty(0, dtype=dtype)})
        except Exception:
            named = [n for n, t in tensors.items() if t.dtype == dtype]
            raise FormatError(
                f"{path}: safetensors cannot hold dtype {dtype} ({', '.join(named[:3])}"
                f"{', ...' if len(named) > 3 else ''}); export with --format torch or dcp, or leave them out with --keys"
            ) from None


def read(path: str, shown: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path``, on CPU; FormatError naming ``shown`` (by
    default ``path``) when it cannot be read."""
    name = path if shown is None else shown
    st = library(name)
    try:
        return st.load_file(os.fspath(path), device="cpu")
    except Exception as exc:  # the library's own errors (SafetensorError) say what is wrong
        raise FormatError(f"{name}: not a readable safetensors file (corrupt or truncated?): {reason(exc)}") from exc
