"""Stop-the-world copy into preallocated pinned host buffers: the floor for a blocking save.

The program stops (synchronize), every state tensor is copied with ``non_blocking=True``
into a pinned buffer allocated once in ``setup`` (allocation is not timed: pinning gigabytes
takes seconds), and the program waits for the copies. Nothing is written anywhere: the
state is captured in host memory, never durable. Its stall is what any stop-the-world
design pays at the device-to-host bandwidth.
"""

from __future__ import annotations

import time

import torch

from gpusnap.bench.system import (
    RestoreResult,
    SaveHandle,
    System,
    blocking_handle,
    sync,
)
from gpusnap.bench.workloads import Workload

__all__ = ["PinnedCopy", "empty_host_cache"]


def empty_host_cache() -> None:
    """Return cached pinned blocks to the driver, so the next system starts from zero."""
    for owner, name in ((getattr(torch, "accelerator", None), "empty_host_cache"), (torch._C, "_host_emptyCache")):
        fn = getattr(owner, name, None)
        if fn is not None:
            try:
                fn()
                return
            except RuntimeError:
                continue


class PinnedCopy(System):
    key = "pinned_copy"
    label = "stop-the-world pinned copy"
    family = "stop-the-world copy"
    target = "pinned host memory"

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def unavailable(self, wl: Workload) -> str | None:
        return None if wl.device.type == "cuda" else "skipped: no CUDA"

    def setup(self, wl: Workload) -> None:
        self._buffers = {
            name: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for name, t in wl.tensors().items()
        }

    def save(self, wl: Workload, index: int) -> SaveHandle:
        started = time.perf_counter()
        sync(wl.device)
        for name, t in wl.tensors().items():
            self._buffers[name].copy_(t, non_blocking=True)
        sync(wl.device)
        return blocking_handle(started, durable=False)

    def restore(self, wl: Workload, target: Workload) -> RestoreResult:
        from gpusnap.bench.measure import timed_step

        sync(target.device)
        t0 = time.perf_counter()
        for name, t in target.tensors().items():
            t.copy_(self._buffers[name], non_blocking=True)
        sync(target.device)
        eager = time.perf_counter() - t0
        return RestoreResult(eager_s=eager, first_step_s=timed_step(target),
                             notes=["from the pinned host copy (no storage involved)"])

    def pinned_bytes(self) -> int | None:
        return sum(b.untyped_storage().nbytes() for b in self._buffers.values())

    def teardown(self) -> None:
        self._buffers = {}
        empty_host_cache()
