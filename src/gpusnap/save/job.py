"""One save on its way from ``save()`` to the commit: what it captured, where, and its timings."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from gpusnap.capture import CaptureCounters
from gpusnap.capture.concurrent import ConcurrentSave
from gpusnap.handles import SaveCompletion
from gpusnap.state.flatten import FlatState
from gpusnap.storage.repository import Repository

__all__ = ["SaveJob", "release_state"]


@dataclass(eq=False)
class SaveJob:
    completion: SaveCompletion
    flat: FlatState
    created: float
    started: float
    blocking: bool
    counters: CaptureCounters
    host_spans: list[torch.Tensor] = field(default_factory=list)  # stop-the-world path
    hashes: list[list[str] | None] = field(default_factory=list)  # device hashes (stop-the-world)
    concurrent: ConcurrentSave | None = None  # concurrent path (it opens its own txn)
    stall_s: float = 0.0  # a blocking save's stall is the whole save
    phases: dict[str, float] = field(default_factory=dict)  # where save() spent its time
    app_state: Any = None  # kept for one retry after a validation failure
    owner: threading.Thread | None = None  # called save(): a retry starts on this thread only
    retry_note: str | None = None  # why this save is a retry
    asked_at: float | None = None  # a retry: when save() was called (its state is from later)
    handed_on: bool = False  # failed validation: its retry (another job) finishes its pending
    repo: Repository | None = None  # where it commits: the root, or the fast tier
    promote: bool = False  # fast tier: promote it whatever the count


def release_state(job: SaveJob) -> None:
    """Drop a finished save's references to the program's state (its mapping, storages and
    tensors), on the writer thread *before* the save is reported done: other holders of the
    job's records (the writer's frame until it returns, the copier's last window) then keep
    no memory of the program alive once ``wait()`` returns."""
    job.app_state = None
    if job.flat is not None:
        for span in job.flat.spans:
            span.release()
