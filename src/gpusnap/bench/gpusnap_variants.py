"""gpusnap's own rows: blocking, concurrent, incremental; eager and lazy restore.

All use the public API only. Each row has one ``Checkpointer`` with ``keep_last=2`` on its
own root, used the way a training loop uses it, so the content-addressed store may skip
chunks a previous save of the row already holds (``bytes_skipped``). The rows differ in
how they save:

- *blocking*: ``save(state, blocking=True)``: returns when durable.
- *concurrent*: ``save(state)``: the program runs on while the state is captured.
- *incremental*: concurrent saves one step apart, the case where only what changed since
  the previous checkpoint should move; its figures are whatever ``info.stats`` reports
  (``bytes_skipped``, ``bytes_written``; missing keys are reported as missing).
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch

import gpusnap
from gpusnap.bench.system import (
    RestoreResult,
    SaveHandle,
    System,
    blocking_handle,
    dir_bytes,
    sync,
)
from gpusnap.bench.verify import compare
from gpusnap.bench.workloads import Workload

__all__ = ["GpusnapBlocking", "GpusnapConcurrent", "GpusnapIncremental", "warm_up_process"]


def warm_up_process(root: str, device: torch.device) -> float:
    """One tiny concurrent save in a throwaway root: pays process-wide first-use costs (the
    ``torch._dynamo`` import a window needs, CUDA streams), so that no row's first save
    carries them. Returns its seconds; the JSON reports them separately."""
    path = os.path.join(root, "warm-up")
    started = time.perf_counter()
    with gpusnap.Checkpointer(path) as ckpt:
        ckpt.save({"t": torch.ones(1024, device=device)}).wait()
    elapsed = time.perf_counter() - started
    shutil.rmtree(path, ignore_errors=True)
    return elapsed


class _GpusnapBase(System):
    family = "gpusnap"

    def __init__(
        self, root: str, *, target: str = "tmpfs", suffix: str = "", config: gpusnap.Config | None = None
    ) -> None:
        self.key = self.key + suffix
        self.label = self.label + (f" ({target})" if suffix else "")
        self.target = target
        self.dir = os.path.join(root, self.key)
        self.config = config
        self.ckpt: gpusnap.Checkpointer | None = None
        self._ids: dict[int, str] = {}
        self._latest: str | None = None

    def setup(self, wl: Workload) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.ckpt = gpusnap.Checkpointer(self.dir, keep_last=2, config=self.config)

    def _done(self, index: int, info: gpusnap.CheckpointInfo) -> dict[str, Any]:
        self._ids[index] = info.id
        self._latest = info.id
        stats = dict(info.stats)
        stats["id"] = info.id
        stats["nbytes"] = info.nbytes
        return stats

    def verify(self, wl: Workload, target: Workload, index: int, expected: dict[str, torch.Tensor]) -> tuple[bool, str]:
        assert self.ckpt is not None
        ckpt_id = self._ids.get(index)
        if ckpt_id is None:
            return False, f"save {index} has no committed checkpoint"
        self.ckpt.restore(target.app_state, ckpt_id).wait()
        sync(target.device)
        return compare(expected, target.tensors())

    def restore(self, wl: Workload, target: Workload) -> RestoreResult | None:
        from gpusnap.bench.measure import timed_step

        assert self.ckpt is not None
        if self._latest is None:
            return None
        result = RestoreResult()
        sync(target.device)
        t0 = time.perf_counter()
        handle = self.ckpt.restore(target.app_state, self._latest)
        handle.wait()
        sync(target.device)
        result.eager_s = time.perf_counter() - t0
        result.stats["eager"] = dict(handle.stats)
        result.first_step_s = timed_step(target)
        try:
            sync(target.device)
            t0 = time.perf_counter()
            handle = self.ckpt.restore(target.app_state, self._latest, lazy=True)
            result.lazy_return_s = time.perf_counter() - t0
            result.lazy_first_step_s = timed_step(target)
            handle.wait()
            sync(target.device)
            result.lazy_total_s = time.perf_counter() - t0
            result.stats["lazy"] = dict(handle.stats)
        except NotImplementedError as exc:
            result.notes.append(f"lazy restore unavailable: {exc}")
        except Exception as exc:  # noqa: BLE001  a lazy restore failure is a finding, not a crash
            result.notes.append(f"lazy restore failed: {type(exc).__name__}: {exc}")
            result.lazy_return_s = result.lazy_first_step_s = result.lazy_total_s = None
        return result

    def bytes_on_disk(self) -> int | None:
        return dir_bytes(self.dir) if os.path.isdir(self.dir) else None

    def notes(self) -> list[str]:
        out = ["bytes on disk: the whole root (keep_last=2: the last two checkpoints, deduplicated)"]
        if not self.measures_restore:
            out.append("restore not timed: the same checkpoint format and restore path as gpusnap concurrent")
        return out

    def teardown(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
            self.ckpt = None
        shutil.rmtree(self.dir, ignore_errors=True)


class GpusnapBlocking(_GpusnapBase):
    key = "gpusnap_blocking"
    label = "gpusnap blocking"
    measures_restore = False  # the same checkpoints and restore path as the concurrent row

    def save(self, wl: Workload, index: int) -> SaveHandle:
        assert self.ckpt is not None
        started = time.perf_counter()
        pending = self.ckpt.save(wl.app_state, blocking=True)
        return blocking_handle(started, self._done(index, pending.wait()))


class GpusnapConcurrent(_GpusnapBase):
    key = "gpusnap_concurrent"
    label = "gpusnap concurrent"
    measures_throughput = True

    def save(self, wl: Workload, index: int) -> SaveHandle:
        assert self.ckpt is not None
        started = time.perf_counter()
        pending = self._call_save(wl)
        handle = SaveHandle(
            started=started,
            returned=time.perf_counter(),
            is_captured=pending.staged,  # side-effect free, unlike wait_staged()
            is_durable=pending.done,
        )
        handle.wait = lambda: self._settle(handle, index, pending)
        return handle

    def _call_save(self, wl: Workload) -> gpusnap.PendingSave:
        """The save call itself (a subclass passes its options)."""
        assert self.ckpt is not None
        return self.ckpt.save(wl.app_state)

    def _settle(self, handle: SaveHandle, index: int, pending: gpusnap.PendingSave) -> dict[str, Any]:
        """Waits until durable; takes the captured and durable moments from gpusnap's own
        stats (same clock, no step-sized resolution) when it reports them."""
        stats = self._done(index, pending.wait())
        window, duration = stats.get("window_s"), stats.get("duration_s")
        if isinstance(duration, (int, float)):
            handle.durable_at = handle.started + duration
        if isinstance(window, (int, float)):
            # The window opens inside save(), so it closed between started + window_s and
            # returned + window_s; the later bound, never past durable or the step-boundary mark.
            bounds = [handle.returned + window]
            bounds += [t for t in (handle.durable_at, handle.captured_at) if t is not None]
            handle.captured_at = max(handle.started + window, min(bounds))
        return stats


class GpusnapIncremental(GpusnapConcurrent):
    key = "gpusnap_incremental"
    label = "gpusnap incremental"
    measures_throughput = False
    measures_restore = False
    gap_steps = 1
