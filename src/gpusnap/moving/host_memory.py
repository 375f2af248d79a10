"""The host memory a suspension's bytes live in: one slab per suspension, page-locked for CUDA.

Page-locked because a suspended CUDA storage points at it (``moving.swap``): under unified
addressing, page-locked host memory is mapped into every device's address space at the same
address, so kernels that still touch a suspended tensor read and write it there, and copies
to and from the device run at full speed without a staging copy. The slab is made exactly as
large as the state (``host_map.MappedMemory``: a ``memfd`` mapping whose pages are faulted
in, then ``cudaHostRegister``), not rounded up to a power of two as torch's pinned
allocator rounds.

Page-locking is slow (tens to hundreds of ms per GiB, paid once per slab), so after a resume
the slab is kept (``keep``) for the next suspend of a state that fits in it; one slab at most
is kept, and :func:`release_host_memory` lets it go. On CPU (no CUDA) the slab is ordinary
host memory and the same code runs.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from gpusnap.errors import CheckpointError
from gpusnap.host_map import MappedMemory

__all__ = ["Slab", "keep", "release_host_memory", "take"]

SLACK = 2  # a kept slab serves a suspend needing at least 1/SLACK of it (else it is let go)


@dataclass(eq=False)
class Slab:
    """``tensor``: ``nbytes`` of host memory (uint8) at ``address``; ``owner`` keeps the
    mapping alive (None: the tensor owns it)."""

    tensor: torch.Tensor
    nbytes: int
    pinned: bool
    owner: Any = None

    @property
    def address(self) -> int:
        return self.tensor.data_ptr()


_lock = threading.Lock()
_kept: Slab | None = None


def take(nbytes: int, *, pinned: bool) -> tuple[Slab, bool, float]:
    """A slab of at least ``nbytes``: the kept one if it fits, else a new one. Returns it,
    whether it was reused, and the seconds spent allocating (and page-locking) it.
    CheckpointError when the host cannot provide it (nothing else changes)."""
    global _kept
    with _lock:
        kept, _kept = _kept, None
    if kept is not None and kept.pinned == pinned and nbytes <= kept.nbytes <= max(nbytes * SLACK, 1 << 20):
        return kept, True, 0.0
    del kept  # (too small or too large: let it go before taking more)
    started = time.perf_counter()
    slab = _allocate(max(nbytes, 1), pinned)
    return slab, False, time.perf_counter() - started


def keep(slab: Slab) -> None:
    """Keep ``slab`` for the next suspend (no storage points into it any more)."""
    global _kept
    with _lock:
        _kept = slab


def release_host_memory() -> int:
    """Let go of the host memory kept for the next suspend; returns its size in bytes.

    Example::

        s = gpusnap.moving.suspend(app_state); s.resume()
        gpusnap.moving.release_host_memory()   # the page-locked slab goes back to the OS
    """
    global _kept
    with _lock:
        kept, _kept = _kept, None
    return 0 if kept is None else kept.nbytes


def _allocate(nbytes: int, pinned: bool) -> Slab:
    if not pinned:
        try:
            return Slab(torch.empty(nbytes, dtype=torch.uint8), nbytes, False)
        except RuntimeError as exc:  # (torch reports a failed host allocation as a RuntimeError)
            raise CheckpointError(f"cannot suspend: no {nbytes} bytes of host memory for the state's copy ({exc}). "
                                  f"Nothing was moved") from exc
    if not hasattr(os, "memfd_create"):
        try:
            return Slab(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), nbytes, True)
        except RuntimeError as exc:
            raise _pin_error(nbytes, exc) from exc
    fd = os.memfd_create("gpusnap-suspend", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
    except OSError as exc:
        os.close(fd)
        raise _pin_error(nbytes, exc) from exc
    try:
        mapped = MappedMemory(fd, nbytes, pinned=True)  # owns fd from here on, closed on failure
    except (OSError, RuntimeError) as exc:
        raise _pin_error(nbytes, exc) from exc
    return Slab(mapped.tensor, nbytes, True, mapped)


def _pin_error(nbytes: int, exc: BaseException) -> CheckpointError:
    return CheckpointError(
        f"cannot suspend: no {nbytes} bytes of page-locked host memory for the state's copy ({exc}); free host "
        f"memory or raise the locked-memory limit (ulimit -l). Nothing was moved"
    )
