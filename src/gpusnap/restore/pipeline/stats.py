"""What one load measured, per stage, so a slow restore says where its time went.

Readers add ``read_s``/``verify_s`` (thread-seconds: divide by ``threads`` for wall time) and
``region_wait_s`` (waiting for a free host region: the copies are behind). The copy thread
adds ``copy_idle_s`` (waiting for a piece: the readers are behind) and ``copy_wait_s``
(waiting for a device event: the copy engine is behind), and ``copy_stream_s``, the time the
copy streams took from the first copy to the last (CUDA only).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["LoadStats"]


@dataclass
class LoadStats:
    bytes_read: int = 0
    chunks_read: int = 0
    pieces: int = 0
    batches: int = 0  # host regions handed to the copy thread: its per-batch work bounds the rate
    batched_spans: int = 0  # whole small spans that shared a region and a copy with others
    reads: int = 0  # system read calls: one per run of chunks stored back to back
    read_s: float = 0.0
    verify_s: float = 0.0
    region_wait_s: float = 0.0
    host_verified_bytes: int = 0
    device_verified_bytes: int = 0
    copy_idle_s: float = 0.0
    copy_wait_s: float = 0.0
    copy_stream_s: float = 0.0
    kernels_wait_s: float = 0.0  # the copy thread waiting for the hash kernels' warm-up (pipeline.warmup)
    first_check_s: float = 0.0  # the copy thread's first device check (without a warm-up, a new process loads its kernels then)
    reader_procs: int = 0  # reader processes the readers used (0: the threads read)
    proc_batches: int = 0  # batches read by a reader process
    proc_fallbacks: int = 0  # batches a reader thread read itself after its process failed
    direct_helpers: int = 0  # direct-copy helpers the load could use (sources.direct_copies; 0: none)
    direct_batches: int = 0  # batches a helper copied from the page cache straight to the device
    direct_s: float = 0.0  # thread-seconds waiting for helpers' copies
    direct_fallbacks: int = 0  # batches staged on the host after a helper failed
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **values: float) -> None:
        """Add to several counters at once (thread-safe)."""
        with self._lock:
            for name, value in values.items():
                setattr(self, name, getattr(self, name) + value)

    def verify_path(self) -> str:
        """``device``, ``host``, ``mixed`` or ``off``: where the chunks were checked."""
        host, device = self.host_verified_bytes, self.device_verified_bytes
        if host and device:
            return "mixed"
        return "device" if device else "host" if host else "off"

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        out["verify_path"] = self.verify_path()
        return out
