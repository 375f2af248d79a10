"""The ``torch.save`` format, read with ``torch.load(weights_only=True)``: tensors and plain
values only, so that reading a file runs no code from it. Storage sharing is kept."""

from __future__ import annotations

import pickle
import re
from typing import Any

import torch

from gpusnap.interop.errors import FormatError, reason
from gpusnap.interop.report import Written

__all__ = ["read", "write"]

_REFUSED = re.compile(r"WeightsUnpickler error:\s*(.+?)(?:\.\s|\n|$)", re.S)


def write(names: dict[str, Any], path: str) -> Written:
    """``torch.save`` of ``names`` (tensors and plain values alike) to the file ``path``."""
    torch.save(names, path)
    return Written()


def read(path: str, shown: str | None = None) -> Any:
    """What ``torch.load(path, weights_only=True)`` gives, on CPU; FormatError naming ``shown``
    (by default ``path``) when the file cannot be read or holds anything but tensors and plain
    values."""
    name = path if shown is None else shown
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = _REFUSED.search(str(exc))
        why = " ".join(found.group(1).split()) if found else reason(exc)
        raise FormatError(
            f"{name}: refused by torch.load(weights_only=True): {why}. gpusnap reads torch.save files as "
            "tensors and plain values only, so that loading runs no code from the file"
        ) from exc
    except Exception as exc:  # (what the zip reader, the unpickler or the OS met: the file is unreadable)
        raise FormatError(f"{name}: not a readable torch.save file (corrupt or truncated?): {reason(exc)}") from exc

