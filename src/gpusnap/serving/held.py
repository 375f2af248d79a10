"""A checkpoint held by the restore server: every span in host memory, checked once, page-locked.

Spans lie in manifest order, each at a page-aligned offset, in one mapping (``MappedMemory``
over a ``memfd``), page-locked when the server copies to a GPU: the copy engine then reads it
at host-to-device speed with no staging. Every chunk is checked against its BLAKE2b digest
while it is read (``Repository.read_chunks_into``); a corrupt checkpoint is not held at all.
Nothing writes the memory after the load, so any number of requests may copy from it at once.
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import ThreadPoolExecutor, wait

from gpusnap.host_map import MappedMemory
from gpusnap.restore.pipeline.staging import SharedMemory
from gpusnap.restore.via_server.protocol import ALIGN
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.repository import Repository

__all__ = ["ALIGN", "HeldCheckpoint", "layout", "load_checkpoint"]

PIECE_BYTES = 16 << 20  # per read task: one system call per run the packs store back to back


def layout(manifest: Manifest) -> tuple[tuple[int, ...], int]:
    """Each span's offset in the held memory, and the memory's size."""
    offsets = []
    at = 0
    for entry in manifest.storages:
        offsets.append(at)
        at += -(-entry.nbytes // ALIGN) * ALIGN
    return tuple(offsets), at


class HeldCheckpoint:
    """``manifest``'s spans in ``memory`` at ``offsets``; read-only once made."""

    def __init__(self, manifest: Manifest, memory: MappedMemory, offsets: tuple[int, ...], load_s: float) -> None:
        self.manifest = manifest
        self.id = manifest.id
        self.digest = manifest.digest()
        self.memory = memory
        self.offsets = offsets
        self.nbytes = manifest.nbytes
        self.load_s = load_s

    @property
    def pinned(self) -> bool:
        return self.memory.pinned

    def address(self, span: int, offset: int, length: int) -> int:
        """Where bytes ``[offset, offset + length)`` of span ``span`` are; ``ValueError``
        outside the span (a request is checked range by range before any copy)."""
        if not 0 <= span < len(self.offsets):
            raise ValueError(f"span {span} does not exist ({len(self.offsets)} in {self.id})")
        size = self.manifest.storages[span].nbytes
        if offset < 0 or length < 0 or offset + length > size:
            raise ValueError(f"bytes [{offset}, {offset + length}) lie outside span {span} ({size} bytes)")
        return self.memory.address + self.offsets[span] + offset


def load_checkpoint(repo: Repository, manifest: Manifest, *, pinned: bool, pool: ThreadPoolExecutor) -> HeldCheckpoint:
    """Read and check every chunk of ``manifest`` into new host memory (page-locked when
    ``pinned``; unpinned with a RuntimeWarning if page-locking fails). Raises
    ``IntegrityError`` / ``StorageError`` as a restore would, ``OSError`` without memory."""
    started = time.perf_counter()
    offsets, total = layout(manifest)
    size = max(total, ALIGN)  # (a checkpoint of plain values only still maps something)
    try:
        memory = SharedMemory(size, pinned=pinned)
    except RuntimeError as exc:
        warnings.warn(f"gpusnap serve: {exc}; {manifest.id} is held in pageable memory (slower copies)",
                      RuntimeWarning, stacklevel=2)
        memory = SharedMemory(size, pinned=False)
    view = memoryview(memory.tensor.numpy())
    cs = manifest.chunk_size
    per = max(1, PIECE_BYTES // cs)
    futures = []
    for i, entry in enumerate(manifest.storages):
        what = f"storage #{i} of {manifest.id}"
        base = offsets[i]
        for k in range(0, len(entry.chunks), per):
            lo, hi = base + k * cs, base + min(entry.nbytes, (k + per) * cs)
            futures.append(pool.submit(repo.read_chunks_into, entry.chunks[k : k + per], view[lo:hi], cs, what=what))
    wait(futures)
    for f in futures:
        f.result()  # the first IntegrityError / StorageError: nothing of this checkpoint is held
    view.release()
    return HeldCheckpoint(manifest, memory, offsets, time.perf_counter() - started)
