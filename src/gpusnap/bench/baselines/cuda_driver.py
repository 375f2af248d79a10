"""The CUDA driver's process checkpoint (``cuCheckpointProcess*``), as a baseline row.

Each "save" is one full cycle on a child process holding the workload's state bytes:
lock, checkpoint (device memory to driver-managed host memory), restore, unlock. The
process cannot run from lock to unlock, so that whole time is the stall; "captured" is
the end of the checkpoint call. Nothing is durable (CRIU would be needed to write the
process image), and the child holds random bytes of the same sizes, not the workload's
own tensors: the driver moves bytes, it does not care what they mean. Its correctness
check is that the child's bytes are unchanged after every cycle.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gpusnap.bench.driver_ckpt import (
    ChildHolder,
    DriverApi,
    DriverError,
    cycle,
    load_driver,
)
from gpusnap.bench.system import (
    RestoreResult,
    SaveHandle,
    System,
    Unavailable,
    blocking_handle,
)
from gpusnap.bench.workloads import Workload

__all__ = ["CudaDriverCheckpoint"]


class CudaDriverCheckpoint(System):
    key = "cuda_checkpoint"
    label = "CUDA driver checkpoint (child process)"
    family = "CUDA driver"
    target = "driver-managed host memory"

    def __init__(self) -> None:
        self._api: DriverApi | None = None
        self._child: ChildHolder | None = None
        self._last: dict[str, float] = {}
        self._info: dict[str, Any] = {}

    def unavailable(self, wl: Workload) -> str | None:
        if wl.device.type != "cuda":
            return "skipped: no CUDA"
        _driver, reason = load_driver()
        return None if reason is None else f"unavailable: {reason}"

    def setup(self, wl: Workload) -> None:
        driver, reason = load_driver()
        if driver is None:
            raise Unavailable(reason)
        try:
            self._api = DriverApi(driver)
            self._info["driver_api_version"] = self._api.version()
        except DriverError as exc:
            raise Unavailable(str(exc)) from exc
        sizes = [t.untyped_storage().nbytes() for t in wl.tensors().values()]
        index = wl.device.index if wl.device.index is not None else torch.cuda.current_device()
        self._child = ChildHolder(sizes, index)
        self._info["child_device_bytes"] = self._child.device_bytes
        try:
            self._info["child_state_before"] = self._api.state(self._child.pid)
        except DriverError as exc:
            raise Unavailable(str(exc)) from exc

    def save(self, wl: Workload, index: int) -> SaveHandle:
        assert self._api is not None and self._child is not None
        started = time.perf_counter()
        try:
            times = cycle(self._api, self._child.pid)
        except DriverError as exc:
            raise Unavailable(str(exc)) from exc
        self._last = times
        handle = blocking_handle(started, dict(times), durable=False)
        handle.captured_at = started + times["lock_s"] + times["checkpoint_s"]
        handle.durable_note = "driver-managed host memory only: never durable without CRIU"
        return handle

    def restore(self, wl: Workload, target: Workload) -> RestoreResult | None:
        if not self._last:
            return None
        return RestoreResult(
            eager_s=self._last["restore_s"] + self._last["unlock_s"],
            notes=[
                (
                    "cuCheckpointProcessRestore + Unlock of the child (from its last cycle); "
                    "no first step: the child is not the workload"
                )
            ],
        )

    def self_check(self) -> tuple[bool, str] | None:
        if self._child is None:
            return None
        now = self._child.current_checksum()
        ok = now == self._child.checksum
        return ok, "child's device bytes unchanged after every cycle" if ok else "child's bytes changed"

    def notes(self) -> list[str]:
        return [f"{k}={v}" for k, v in self._info.items()]

    def teardown(self) -> None:
        if self._child is not None:
            self._child.close()
            self._child = None
