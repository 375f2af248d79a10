"""How the next save captures: Config, what earlier saves taught the capture history, and
the devices' free memory make one frozen :class:`CapturePlan`.

The planner also owns what plans share across saves: the pinned staging arena, one
low-priority copy stream per device, and the save kernels loading beside the program's
set-up (``capture/warmup.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gpusnap.capture.fast_arena import FastArena
from gpusnap.capture.history import CaptureHistory
from gpusnap.capture.options import CaptureOptions
from gpusnap.capture.staging import StagingArena
from gpusnap.capture.warmup import WARMUP_JOIN_S, start_capture_warmup
from gpusnap.config import Config
from gpusnap.device import own_stream
from gpusnap.state.flatten import FlatState
from gpusnap.storage.repository import Repository

__all__ = ["CapturePlan", "CapturePlanner"]


@dataclass(frozen=True)
class CapturePlan:
    """One concurrent save's capture: its options, the memory it copies through (pinned
    staging, or the fast tier's reserved slabs) and the copy stream of each device."""

    options: CaptureOptions
    staging: StagingArena | FastArena
    streams: Mapping[torch.device, Any]


class CapturePlanner:
    """>>> CapturePlanner(Config(warm_up_kernels=False, cow_budget_bytes=1 << 20)).device_budgets([])
    (1048576, 1048576)
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        # what saves learn from each other: plans, orders, hashes (capture/history.py)
        self.history = CaptureHistory(config.chunk_size)
        self._staging: StagingArena | None = None
        self._streams: dict[torch.device, Any] = {}
        # the save kernels load beside the program's set-up, not in the first save()
        self._warmup = (start_capture_warmup(config.chunk_size, self.copy_stream)
                        if config.concurrent and config.warm_up_kernels else None)

    def previous(self, repo: Repository) -> tuple[Any, bool]:
        """The latest checkpoint's chunks to compare with, and whether to compare. Read
        before the save's transaction opens: its view of stored chunks must include every
        chunk the previous checkpoint committed (a later commit may replace it)."""
        previous = self.history.previous_spans(repo) if self.config.incremental else None
        return previous, bool(previous) and self.history.should_compare()

    def staging_for(self, cuda: list[torch.device], device_bytes: int, fast_txn: Any,
                    phases: dict[str, float]) -> StagingArena | FastArena:
        """The memory a save copies through: the fast tier's reserved slabs, or the staging
        arena, grown once to hold a whole capture (timed in ``phases``). The kernels'
        warm-up is not waited for here: a save that needs its kernels at ``save()`` waits
        for them there, the others on the copier's thread (``capture/warmup.py``)."""
        if fast_txn is not None:
            arena: StagingArena | FastArena = FastArena(fast_txn, self.config.piece_bytes())
        else:
            arena = self.staging_arena(pinned=bool(cuda))
        # Pinned allocation is slow and stalls the program while it runs; so the arena grows
        # here, once, to hold one whole capture (the first save pays for it, like
        # async_save's first call), never while a window copies.
        if device_bytes and fast_txn is None:
            assert isinstance(arena, StagingArena)
            with torch.inference_mode(False):  # the copier writes it
                phases["reserve_staging"] = arena.reserve(device_bytes + self.config.piece_bytes())
        return arena

    def plan(self, flat: FlatState, cuda: list[torch.device], staging: StagingArena | FastArena,
             previous: Any, compare: bool, phases: dict[str, float]) -> CapturePlan:
        """The plan for ``flat``, whose CUDA devices are ``cuda`` (the budgets' time goes in
        ``phases``)."""
        opened = time.perf_counter()
        cow_budget, snapshot_budget = self.device_budgets(cuda)
        phases["open_window.budgets"] = time.perf_counter() - opened
        config = self.config
        options = CaptureOptions(
            chunk_size=config.chunk_size,
            piece_bytes=config.piece_bytes(),
            ahead=config.copy_ahead,
            order=self.history.copy_order(flat),
            cow_budget=cow_budget,
            eager_cpu_bytes=config.eager_cpu_bytes,
            log_reads=self.history.logs_reads(),
            validate=config.validate,
            previous=previous,
            skip_unchanged=compare,
            eager=tuple(self.history.eager_spans(flat)),
            eager_device_bytes=config.eager_device_bytes,
            snapshot_budget=snapshot_budget if config.device_snapshot else 0,
            snapshot_cpu_bytes=config.cpu_snapshot_bytes,
            fast=isinstance(staging, FastArena),
        )
        return CapturePlan(options, staging, {d: self.copy_stream(d) for d in cuda})

    def device_budgets(self, cuda: list[torch.device]) -> tuple[int, int]:
        """Device bytes for copy-on-write shadows, and for a whole-state snapshot.

        Copy-on-write: ``cow_budget_bytes``, else a quarter of what is free in the driver plus
        what torch's caching allocator holds unused (host memory on CPU). Snapshot: the same,
        and at most half of what the driver has free: the allocator's free blocks are the
        program's activations of the next step; taking them would make it allocate, or make
        this allocation free cached blocks, which synchronizes the device."""
        if self.config.cow_budget_bytes:
            return self.config.cow_budget_bytes, self.config.cow_budget_bytes
        if cuda:
            free = {d: torch.cuda.mem_get_info(d)[0] for d in cuda}
            cow = min(free[d] + torch.cuda.memory_reserved(d) - torch.cuda.memory_allocated(d) for d in cuda) // 4
            return cow, min(cow, min(free.values()) // 2)
        try:
            cow = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
        except (ValueError, OSError, AttributeError):
            cow = 1 << 30
        return cow, cow

    def staging_arena(self, *, pinned: bool) -> StagingArena:
        arena = self._staging
        if arena is None or (pinned and not arena.pinned):
            capacity = self.config.staging_capacity()
            slab = min(capacity, max(256 << 20, self.config.piece_bytes()))
            arena = self._staging = StagingArena(capacity, pinned=pinned, slab_bytes=slab)
        return arena

    def reserve_staging(self, device_bytes: int) -> int:
        """Grow the pinned staging for a save of ``device_bytes`` of CUDA state now (set-up);
        returns its bytes."""
        if not device_bytes or not torch.cuda.is_available():
            return 0
        arena = self.staging_arena(pinned=True)
        with torch.inference_mode(False):
            arena.reserve(device_bytes + self.config.piece_bytes())
        return arena.nbytes

    def copy_stream(self, device: torch.device) -> Any:
        """The device's low-priority copy stream: gpusnap's own (``device.own_stream``)."""
        stream = self._streams.get(device)
        if stream is None:
            low, _high = torch.cuda.Stream.priority_range()
            stream = self._streams[device] = own_stream(device, low)
        return stream

    def join_warmup(self, timeout: float = WARMUP_JOIN_S) -> None:
        """Wait (bounded) for the save kernels to load."""
        if self._warmup is not None:
            self._warmup.join(timeout)
