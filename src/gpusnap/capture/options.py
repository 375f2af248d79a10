"""How one concurrent save captures, as one frozen object.

The Checkpointer chooses it for each save from its ``Config``, the devices' memory budgets and
what earlier saves taught its :class:`~gpusnap.capture.history.CaptureHistory`; the capture
layer (``ConcurrentSave``, its window and copier) only reads it.

>>> CaptureOptions(chunk_size=1 << 20, piece_bytes=32 << 20, ahead=1, order=(1, 0), cow_budget=0,
...                eager_cpu_bytes=0).fast
False
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["CaptureOptions"]


@dataclass(frozen=True)
class CaptureOptions:
    chunk_size: int
    piece_bytes: int  # bytes per device-to-host copy (whole chunks)
    ahead: int  # copies in flight at most (docs/capture.md)
    order: Sequence[int]  # span indices, first copied first (read only: the history's memo, shared)
    cow_budget: int  # device bytes of copy-on-write shadows at most
    eager_cpu_bytes: int  # host spans up to this size are copied at save()
    log_reads: bool = True  # log the program's read order (a lazy restore loads in it)
    validate: bool = True  # hash each chunk before and after its copy
    previous: Mapping[str, str] | None = None  # the latest checkpoint: device hash -> digest (incremental)
    skip_unchanged: bool = True  # compare with ``previous`` before copying
    eager: tuple[int, ...] = ()  # spans captured at save() (once written unseen)
    eager_device_bytes: int = 0
    snapshot_budget: int = 0  # device bytes of a whole-state snapshot at save() at most
    snapshot_cpu_bytes: int = 0
    fast: bool = False  # into the fast tier's slabs: chunks named by device hash and place
