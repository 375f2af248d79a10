"""``torch.save`` of every state tensor, the way most training scripts checkpoint.

Written to a temporary name, flushed, fsynced and renamed (what a careful user does, and
what gpusnap's commit does), so "durable" means the same thing for both. On tmpfs the fsync
costs nothing; on a disk it is the honest price of durability.
"""

from __future__ import annotations

import os
import shutil
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

__all__ = ["TorchSave"]


class TorchSave(System):
    family = "torch.save"

    def __init__(self, root: str, *, target: str) -> None:
        self.key = f"torch_save_{target}"
        self.label = f"torch.save ({target})"
        self.target = target
        self.dir = os.path.join(root, self.key)
        self.path = os.path.join(self.dir, "state.pt")

    def setup(self, wl: Workload) -> None:
        os.makedirs(self.dir, exist_ok=True)

    def save(self, wl: Workload, index: int) -> SaveHandle:
        started = time.perf_counter()
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            torch.save(wl.tensors(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return blocking_handle(started)

    def restore(self, wl: Workload, target: Workload) -> RestoreResult:
        from gpusnap.bench.measure import timed_step

        sync(target.device)
        t0 = time.perf_counter()
        loaded = torch.load(self.path, map_location=target.device, weights_only=True)
        dst = target.tensors()
        for name, value in loaded.items():
            dst[name].copy_(value)
        del loaded
        sync(target.device)
        eager = time.perf_counter() - t0
        return RestoreResult(eager_s=eager, first_step_s=timed_step(target),
                             notes=["torch.load(map_location=device, weights_only=True), then copy_ in place"])

    def bytes_on_disk(self) -> int | None:
        return os.path.getsize(self.path) if os.path.exists(self.path) else None

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
