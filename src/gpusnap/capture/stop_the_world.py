"""Stop-the-world capture: copy every span to the host, then chunk, hash and store it.

This is the baseline path (``save(blocking=True)``, and the foundation of the background
save): the caller is held while device bytes move to the host, so the bytes are trivially
consistent. Life of a span here: ``live -> host copy -> chunks hashed -> chunks stored``.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from gpusnap.device import to_host
from gpusnap.capture.validation import HashTable
from gpusnap.kernels.hashing import chunk_digest
from gpusnap.state.flatten import FlatState
from gpusnap.storage import ChunkSink, StorageEntry

__all__ = ["CaptureCounters", "snapshot_to_host", "write_host_spans"]


@dataclass
class CaptureCounters:
    """Byte counts reported in a checkpoint's stats (thread-safe increments). ``progress``
    is told every chunk's bytes stored (written or already there), one call at a time."""

    bytes_total: int = 0
    bytes_copied: int = 0
    bytes_written: int = 0
    bytes_skipped: int = 0
    progress: Callable[[int], None] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, *, written: int = 0, skipped: int = 0) -> None:
        with self._lock:
            self.bytes_written += written
            self.bytes_skipped += skipped
            if self.progress is not None:  # (under the lock: a callback sees no concurrent call)
                self.progress(written + skipped)


def snapshot_to_host(
    flat: FlatState, *, copy_cpu: bool, chunk_size: int | None = None
) -> tuple[list[torch.Tensor], int, list[list[str] | None]]:
    """Host bytes of every span, in span order, how many bytes were copied, and (with
    ``chunk_size``) the device chunk hashes of CUDA spans (None for CPU spans).

    CUDA spans are always copied (in stream order, so work already enqueued counts as
    before the consistent point); their hashes are computed on the device first (cheap there;
    incremental saves and device-side restore checks use them). CPU spans are aliased unless
    ``copy_cpu``: a blocking save holds the caller until the bytes are stored.
    """
    out: list[torch.Tensor] = []
    copied = 0
    cuda = [i for i, s in enumerate(flat.spans) if s.device.type == "cuda" and s.nbytes]
    table = HashTable(flat.spans, chunk_size) if chunk_size is not None and cuda else None
    if table is not None:  # before the copies, in stream order: one call per device
        table.fill_many(cuda, [flat.spans[i].as_bytes() for i in cuda])
        table.to_host_async()
    for span in flat.spans:
        data = span.as_bytes()
        needs_copy = copy_cpu or data.device.type != "cpu"
        out.append(to_host(data, copy=needs_copy))
        copied += span.nbytes if needs_copy else 0
    hashes: list[list[str] | None] = [None] * len(flat.spans)
    if table is not None:
        hexes = table.hex()
        for i in cuda:
            hashes[i] = hexes[i]
    return out, copied, hashes


def _chunk_views(data: torch.Tensor, chunk_size: int) -> list[memoryview]:
    """``data``'s bytes (contiguous uint8 on the host) in chunks, which keep ``data`` alive.

    Through their address, not ``data.numpy()``: exporting to numpy marks the storage not
    resizable for good, and ``data`` may be the program's own (a blocking save aliases CPU
    spans), whose ``resize_`` and ``gpusnap.suspend`` would then be refused after a save."""
    memory = (ctypes.c_uint8 * data.numel()).from_address(data.data_ptr())
    # held by every view, as numpy's array held it
    memory.data = data  # type: ignore[attr-defined]
    view = memoryview(memory).cast("B")
    return [view[off : off + chunk_size] for off in range(0, len(view), chunk_size)]


def write_host_spans(
    flat: FlatState,
    host_spans: Sequence[torch.Tensor],
    txn: ChunkSink,
    *,
    chunk_size: int,
    pool: ThreadPoolExecutor,
    counters: CaptureCounters,
    hashes: Sequence[Sequence[str] | None] = (),
    piece_bytes: int = 32 << 20,
) -> tuple[StorageEntry, ...]:
    """Hash and store every chunk of every span (one task per ``piece_bytes`` of a span);
    returns the manifest's storage table."""

    def store(views: list[memoryview]) -> list[str]:
        digests = []
        for view in views:  # in order, on one thread: a span's chunks land back to back
            digest = chunk_digest(view)
            if txn.has_chunk(digest) or not txn.put_chunk(digest, view):
                counters.add(skipped=len(view))
            else:
                counters.add(written=len(view))
            digests.append(digest)
        return digests

    per_task = max(1, piece_bytes // chunk_size)
    futures = []
    for d in host_spans:
        views = _chunk_views(d, chunk_size)
        futures.append([pool.submit(store, views[i : i + per_task]) for i in range(0, len(views), per_task)])
    # Let every chunk finish before raising, so no worker still writes into an aborted txn.
    wait([f for per_span in futures for f in per_span])
    entries = []
    for i, (span, group_futures) in enumerate(zip(flat.spans, futures)):
        digests = tuple(d for f in group_futures for d in f.result())
        h = hashes[i] if i < len(hashes) else None
        entries.append(
            StorageEntry(nbytes=span.nbytes, device=str(span.device), chunks=digests,
                         hashes=None if h is None else tuple(h))
        )
        counters.bytes_total += span.nbytes
    return tuple(entries)
