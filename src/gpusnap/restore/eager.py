"""Verify-first restore: read and verify every chunk of every span, then hand the spans to the plan.

Pieces of consecutive chunks are read by a thread pool straight into host buffers (one
system call per run the packs store back to back), each chunk checked against its digest by
the repository. Nothing is applied until every chunk has been verified, so a
corrupt checkpoint raises ``IntegrityError`` and leaves the targets untouched (at the cost
of holding the checkpoint in host memory; ``restore.pipeline.loader`` streams instead). This is
``restore(..., verify="upfront")``, and ``verify="auto"`` for small checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass
from typing import Any

import torch

from gpusnap.device import host_buffer, only_gpu
from gpusnap.restore.apply_bytes import apply_span
from gpusnap.restore.pipeline.loader import describe_span
from gpusnap.state.plan import RestorePlan
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.repository import Repository

__all__ = ["PIECE_BYTES", "RestoreCounters", "load_spans"]

PIECE_BYTES = 16 << 20  # per read task (unless a caller passes piece_bytes)


@dataclass
class RestoreCounters:
    bytes_read: int = 0
    chunks_read: int = 0


def load_spans(
    repo: Repository,
    manifest: Manifest,
    plan: RestorePlan,
    *,
    pool: ThreadPoolExecutor,
    apply: Callable[[int, torch.Tensor], None] | None = None,
    progress: Callable[[int], None] | None = None,
    piece_bytes: int = 0,
    pinned: bool = False,
) -> RestoreCounters:
    """Read, verify and apply every span of ``manifest`` through ``plan``: by
    ``apply_bytes.apply_span``, or ``apply(index, data)`` when given (``gpusnap.load`` keeps
    the buffers instead). ``progress``: called on this thread with the bytes of each read
    task as it completes (all of them: they sum to the spans' bytes). ``piece_bytes``: bytes
    per read task (0: :data:`PIECE_BYTES`). ``pinned``: spans bound for one GPU are read into
    page-locked memory."""
    counters = RestoreCounters()
    cs = manifest.chunk_size
    per = max(1, (piece_bytes or PIECE_BYTES) // cs)  # chunks per read task: one system call per run stored back to back
    buffers: list[torch.Tensor] = []
    futures = []
    sizes: list[int] = []  # each read task's bytes
    for index, entry in enumerate(manifest.storages):
        check_on = only_gpu(plan.devices(index))  # (where device-named chunks are checked)
        buf = host_buffer(entry.nbytes, pinned=pinned and check_on is not None)
        buffers.append(buf)
        view = memoryview(buf.numpy()).cast("B")
        what = describe_span(plan, index)
        for k in range(0, len(entry.chunks), per):
            piece = view[k * cs : (k + per) * cs]
            futures.append(pool.submit(repo.read_chunks_into, entry.chunks[k : k + per], piece, cs, what=what,
                                       check_on=check_on))
            sizes.append(len(piece))
        counters.bytes_read += entry.nbytes
        counters.chunks_read += len(entry.chunks)
    _wait(futures, sizes, progress)
    for f in futures:
        f.result()  # re-raise the first IntegrityError/StorageError before any byte moves
    for index, buf in enumerate(buffers):
        if apply is None:
            apply_span(plan, index, buf)
        else:
            apply(index, buf)
    return counters


def _wait(futures: list[Future[Any]], sizes: list[int], progress: Callable[[int], None] | None) -> None:
    """Wait for every read task; with ``progress``, tell each one's bytes as it completes."""
    try:
        if progress is not None:
            size = dict(zip(futures, sizes))
            for f in as_completed(futures):
                if f.exception() is not None:
                    break  # (a failed read is no progress; the caller's result() raises it)
                progress(size[f])
    finally:
        wait(futures)  # (a raising progress too: no task still writes into the buffers after)
