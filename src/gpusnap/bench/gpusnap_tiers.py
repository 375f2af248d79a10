"""gpusnap's rows in the cost suite: the default Checkpointer, and the fast tier (milestone 2).

- *default*: ``Checkpointer(root, keep_last=2)``, ``save(state)``; durable = in ``root`` (with
  the memory tier: once promoted); *default, promote_every=10*: durable every 10th save.
- *fast tier*: ``Checkpointer(root, keep_last=2, fast_root=FAST, fast_keep_last=2,
  promote_every=P)``; ``save(state)`` commits to the fast tier (host memory that outlives
  the process), every P-th save is promoted to ``root`` in the background. Its cost window
  ends when the save is committed to the fast tier (what ``pending.wait()`` waits for);
  promotion runs later, and its CPU is reported apart where the Checkpointer reports it
  (``info.stats["promotion_cpu_s"]``; None otherwise). Each save's ``info.tier`` is kept.
  Set-up calls ``prepare(state, wait=True)``, as docs/tiers.md tells a user to: the
  slabs are made before the first save, not in its window.

A gpusnap without the fast tier (its ``Checkpointer`` takes no ``fast_root``) makes the
fast row ``unavailable: this gpusnap has no fast tier``, so the suite runs either way.
"""

from __future__ import annotations

import inspect
import os
import shutil
import time
from typing import Any

import gpusnap
from gpusnap.bench.gpusnap_variants import GpusnapConcurrent
from gpusnap.bench.system import SaveHandle, dir_bytes
from gpusnap.bench.workloads import Workload

__all__ = ["NO_FAST_TIER", "GpusnapDefault", "GpusnapDefaultSparse", "GpusnapFast", "has_fast_tier"]

NO_FAST_TIER = "unavailable: this gpusnap has no fast tier"


def has_fast_tier() -> bool:
    try:
        return "fast_root" in inspect.signature(gpusnap.Checkpointer).parameters
    except (TypeError, ValueError):
        return False


class GpusnapDefault(GpusnapConcurrent):
    """``Checkpointer(root, keep_last=2)`` as the README makes it. A save is durable when its
    manifest is in ``root``: with the memory tier that is after its promotion, so the cost
    window runs on, a step at a time, until the background write to the disk is over."""

    key = "gpusnap_default"
    label = "gpusnap default"
    mid_step_check = True  # a save between backward() and optimizer.step(): copy-on-write heavy

    def save(self, wl: Workload, index: int) -> SaveHandle:
        handle = super().save(wl, index)
        pending, settle = self._last_pending, handle.wait

        def in_root() -> bool:
            return pending.done() and os.path.exists(os.path.join(self.dir, "manifests", f"{pending.id}.json"))

        def wait() -> dict[str, Any]:
            marked = handle.durable_at  # (the step that saw it in the root, if one did)
            stats = settle()
            handle.durable_at = marked  # (settle() put the fast-tier commit's moment there)
            assert self.ckpt is not None
            if not in_root():  # every promotion over: this one's, or the newer one that replaced it
                self.ckpt.wait()
            if not in_root():
                handle.durable_note = "its promotion was replaced by a newer save's (the disk was busy)"
                stats["tier"] = "fast"
                return stats
            handle.durable_at = handle.durable_at or time.perf_counter()
            durable = next((i for i in self.ckpt.list() if i.id == pending.id and i.tier == "durable"), None)
            if durable is not None:
                stats["tier"] = "durable"
                stats["promotion_s"] = durable.stats.get("promotion_s")
                stats["promotion_cpu_s"] = durable.stats.get("promotion_cpu_s")
            return stats

        handle.is_durable = in_root
        handle.wait = wait
        return handle

    def _call_save(self, wl: Workload) -> gpusnap.PendingSave:
        self._last_pending = super()._call_save(wl)
        return self._last_pending


class GpusnapDefaultSparse(GpusnapConcurrent):
    """``Checkpointer(root, keep_last=2, promote_every=10)``: the default memory tier, every
    10th save made durable; a save's window ends at its commit in memory."""

    key = "gpusnap_default_p10"
    label = "gpusnap default, promote_every=10"
    mid_step_check = True

    def unavailable(self, wl: Workload) -> str | None:
        config = self.config if self.config is not None else gpusnap.Config.from_env()
        return "unavailable: the memory tier is off (Config.memory_tier)" if config.memory_tier_mode() == "off" else None

    def setup(self, wl: Workload) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.ckpt = gpusnap.Checkpointer(self.dir, keep_last=2, config=self.config, promote_every=10)


class GpusnapFast(GpusnapConcurrent):
    key = "gpusnap_fast"
    label = "gpusnap fast tier"
    mid_step_check = True

    def __init__(self, root: str, fast_root: str, *, promote_every: int = 10, target: str = "tmpfs") -> None:
        super().__init__(root, target=target)
        self.fast_dir = os.path.join(fast_root, self.key)
        self.promote_every = promote_every
        self._promote = False

    def unavailable(self, wl: Workload) -> str | None:
        return None if has_fast_tier() else NO_FAST_TIER

    def setup(self, wl: Workload) -> None:
        for path in (self.dir, self.fast_dir):
            shutil.rmtree(path, ignore_errors=True)
        kwargs: dict[str, Any] = {"fast_root": self.fast_dir, "fast_keep_last": 2, "promote_every": self.promote_every}
        self.ckpt = gpusnap.Checkpointer(self.dir, keep_last=2, config=self.config, **kwargs)
        if hasattr(self.ckpt, "prepare"):  # as the docs tell a user: slabs made at set-up, not in save 0
            self.ckpt.prepare(wl.app_state, wait=True)

    def settle(self, wl: Workload) -> None:
        if self.ckpt is not None and hasattr(self.ckpt, "prepare"):  # the slabs the first save set aside, made
            self.ckpt.prepare(wl.app_state, wait=True)

    def promoted_save(self, wl: Workload, index: int) -> SaveHandle:
        """Save ``index`` with ``promote=True`` (promoted whatever the count)."""
        self._promote = True
        try:
            return self.save(wl, index)
        finally:
            self._promote = False

    def promotion(self, index: int) -> dict[str, Any] | None:
        """Save ``index`` as ``list()`` shows it once promoted (tier "durable"), else None."""
        assert self.ckpt is not None
        ckpt_id = self._ids.get(index)
        info = next((i for i in self.ckpt.list() if i.id == ckpt_id and getattr(i, "tier", None) == "durable"), None)
        return None if info is None else {"tier": "durable", "promotion_cpu_s": info.stats.get("promotion_cpu_s")}

    def _call_save(self, wl: Workload) -> gpusnap.PendingSave:
        assert self.ckpt is not None
        if self._promote:
            return self.ckpt.save(wl.app_state, promote=True)  # type: ignore[call-arg]
        return self.ckpt.save(wl.app_state)

    def _done(self, index: int, info: gpusnap.CheckpointInfo) -> dict[str, Any]:
        stats = super()._done(index, info)
        stats["tier"] = getattr(info, "tier", None)
        stats.setdefault("promotion_cpu_s", None)
        return stats

    def bytes_on_disk(self) -> int | None:
        sizes = [dir_bytes(p) for p in (self.dir, self.fast_dir) if os.path.isdir(p)]
        return sum(sizes) if sizes else None

    def notes(self) -> list[str]:
        return [(f"fast tier {self.fast_dir}, fast_keep_last=2, promote_every={self.promote_every}; durable root "
                 f"{self.dir} (keep_last=2); a window ends at the fast-tier commit")]

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            shutil.rmtree(self.fast_dir, ignore_errors=True)
