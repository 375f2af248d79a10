"""Bit-exactness checks: clones at the consistent point, compared byte for byte."""

from __future__ import annotations

import torch

from gpusnap.bench.system import sync
from gpusnap.bench.workloads import Workload

__all__ = ["clone_state", "compare"]


def clone_state(wl: Workload) -> dict[str, torch.Tensor]:
    """Device clones of every state tensor, taken after all enqueued work (the state a save
    issued right after this call must capture)."""
    sync(wl.device)
    out = {name: t.clone() for name, t in wl.tensors().items()}
    sync(wl.device)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.uint8) if t.dim() > 0 else t.reshape(1).view(torch.uint8)


def compare(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> tuple[bool, str]:
    """(True, summary) when every tensor matches bit for bit (NaN payloads included)."""
    if expected.keys() != got.keys():
        missing = sorted(set(expected) ^ set(got))[:3]
        return False, f"different tensor names, e.g. {missing}"
    for name, want in expected.items():
        have = got[name]
        if have.shape != want.shape or have.dtype != want.dtype:
            return False, f"{name}: {have.dtype}{list(have.shape)} != {want.dtype}{list(want.shape)}"
        if not torch.equal(_bytes(have), _bytes(want.to(have.device))):
            return False, f"{name}: bytes differ"
    return True, f"{len(expected)} tensors bitwise equal"
