"""Validation of the speculation, and dirty tracking, with device-side chunk hashes.

The tracker sees writes through the dispatcher only; a custom kernel, a cupy/numpy view, a
CUDA-graph replay it was not told about, or a hand-launched Triton kernel can change a buffer
unseen. So every chunk is hashed twice (``kernels.chunk_hash``, 128 bits, on the span's
device):

* ``before``: at the consistent point, in the program's stream order (inside ``save()``; the
  CPU does not wait on CUDA; CPU spans are hashed right there);
* ``after``: right after the chunk's copy, from the same bytes the copy read (the live
  storage or its copy-on-write shadow), on the copy stream *before* the piece's event, so a
  tracked write (which waits for that event) cannot cause a false alarm. CPU pieces are
  hashed from their staged copy.

An unseen write before the copy changes ``after`` (sound); one between the copy and the
second hash can only cause a false alarm. Any mismatch fails the save with
:class:`~gpusnap.ValidationError` naming the tensors; nothing is committed.

The ``before`` hashes also make saves incremental: a chunk whose hash equals a chunk hash
stored in the previous checkpoint (any tensor: the hash covers the bytes and the length) is
not copied nor written again; the manifest refers to the stored chunk (a 128-bit hash match
is trusted as identity: documented).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, KeysView, Mapping, Sequence
from itertools import accumulate, chain, count, pairwise
from typing import Any

import numpy as np
import torch

from gpusnap.device import waitable_event
from gpusnap.kernels.chunk_hash import (
    HASH_WORDS,
    chunk_hashes,
    hex_rows,
    num_chunks,
)
from gpusnap.kernels.chunk_hash_many import chunk_hashes_many, chunk_hashes_packed
from gpusnap.state.flatten import StorageSpan
from gpusnap.storage import Manifest

__all__ = ["HashTable", "KnownChunks", "known_chunks", "unchanged_chunks"]


class HashTable:
    """Per-chunk hashes of every span: one ``(rows, 2)`` int64 tensor per device.

    Span ``i``'s chunk ``k`` is row ``first[i] + k`` of the table of ``spans[i].device``.
    """

    def __init__(self, spans: Sequence[StorageSpan], chunk_size: int) -> None:
        # (vectorized: save() builds one for thousands of spans on the program's thread)
        self.chunk_size = chunk_size
        self.spans_nbytes = [s.nbytes for s in spans]
        self.devices = [s.device for s in spans]
        codes: dict[torch.device, int] = {}
        code = np.fromiter((codes.setdefault(d, len(codes)) for d in self.devices), dtype=np.int64, count=len(spans))
        counts = -(-np.asarray(self.spans_nbytes, dtype=np.int64) // chunk_size)
        first = np.empty_like(counts)
        totals: dict[torch.device, int] = {}
        for device, k in codes.items():
            mine = code == k
            running = np.cumsum(counts[mine])
            first[mine] = running - counts[mine]
            totals[device] = int(running[-1])
        self.counts: list[int] = counts.tolist()
        self.first: list[int] = first.tolist()
        self.tables = {d: torch.zeros((n, HASH_WORDS), dtype=torch.int64, device=d) for d, n in totals.items()}
        self._host: dict[torch.device, torch.Tensor] = {}
        self._events: dict[torch.device, Any] = {}

    def rows(self, index: int, first_chunk: int = 0, count: int | None = None) -> torch.Tensor:
        n = self.counts[index] - first_chunk if count is None else count
        start = self.first[index] + first_chunk
        return self.tables[self.devices[index]][start : start + n]

    def fill(self, index: int, data: torch.Tensor, first_chunk: int = 0) -> None:
        """Hash ``data`` (the bytes of chunks ``first_chunk``... of span ``index``) into the
        table, on the current stream (asynchronous on CUDA)."""
        if data.numel():
            count = num_chunks(data.numel(), self.chunk_size)
            chunk_hashes(data, self.chunk_size, out=self.rows(index, first_chunk, count))

    def fill_many(self, indices: Sequence[int], datas: Sequence[torch.Tensor]) -> None:
        """Hash whole spans, ``datas[j]`` being all of span ``indices[j]``'s bytes, on the
        current streams (asynchronous on CUDA): one :func:`chunk_hashes_many` call per device,
        so a few launches instead of two per span. Spans whose rows do not follow each other
        in the table (others left out) are hashed into a temporary and scattered with one
        ``index_copy_``."""
        groups: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
        for index, data in zip(indices, datas, strict=True):
            if num_chunks(data.numel(), self.chunk_size) != self.counts[index]:
                raise ValueError(
                    f"span {index} has {self.counts[index]} chunks, its data {data.numel()} bytes: "
                    "fill_many takes whole spans (use fill for pieces)"
                )
            if self.counts[index]:
                group = groups.setdefault(self.devices[index], ([], []))
                group[0].append(index)
                group[1].append(data)
        for device, (idx, data) in groups.items():
            table = self.tables[device]
            runs = [(self.first[i], self.first[i] + self.counts[i]) for i in idx]
            if all(end == start for (_, end), (start, _) in pairwise(runs)):
                chunk_hashes_many(data, self.chunk_size, out=table[runs[0][0] : runs[-1][1]])
                continue
            total = sum(self.counts[i] for i in idx)
            rows = torch.empty((total, HASH_WORDS), dtype=torch.int64, device=device)
            chunk_hashes_many(data, self.chunk_size, out=rows)
            counts = torch.tensor([self.counts[i] for i in idx], dtype=torch.int64)
            starts = torch.tensor([a for a, _ in runs], dtype=torch.int64)
            first = torch.cumsum(counts, 0).sub_(counts)  # each span's first row in ``rows``
            where = torch.arange(total, dtype=torch.int64)  # -> each row's place in the table
            where += torch.repeat_interleave(starts - first, counts, output_size=total)
            if device.type == "cuda":  # from pinned memory: the host does not wait
                where = where.pin_memory().to(device, non_blocking=True)
            table.index_copy_(0, where, rows)

    def fill_packed(self, indices: Sequence[int], buffer: torch.Tensor, offsets: Sequence[int]) -> None:
        """:meth:`fill_many` of whole spans packed in one buffer, span ``indices[j]`` at
        ``buffer[offsets[j]:]`` (a snapshot): no tensor per span, so little host time on a
        thread that competes with the program for the GIL. Rows must follow each other in
        the table (every span of the device, in order), else it falls back to fill_many."""
        idx = np.asarray(indices, dtype=np.int64)
        if not len(idx):
            return
        first = np.asarray(self.first, dtype=np.int64)[idx]
        counts = np.asarray(self.counts, dtype=np.int64)[idx]
        device = buffer.device  # (one buffer: every span of ``indices`` is on its device)
        if not np.all(first[1:] == first[:-1] + counts[:-1]):
            sizes = [self.spans_nbytes[i] for i in indices]
            self.fill_many(indices, [buffer[o : o + n] for o, n in zip(offsets, sizes)])
            return
        sizes = np.asarray(self.spans_nbytes, dtype=np.int64)[idx]
        table = self.tables[device]
        chunk_hashes_packed(buffer, offsets, sizes, self.chunk_size,
                            out=table[int(first[0]) : int(first[-1] + counts[-1])])

    def to_host_async(self) -> None:
        """Start copying every device table to the host (on the current streams)."""
        for device, table in self.tables.items():
            if device.type == "cuda":
                host = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
                host.copy_(table, non_blocking=True)
                event = waitable_event()
                event.record(torch.cuda.current_stream(device))
                self._host[device], self._events[device] = host, event
            else:
                self._host[device] = table

    def hex(self) -> list[tuple[str, ...]]:
        """Hex hashes per span (waits for the device tables' copies). Tuples of str: Python's
        collector stops tracking them (a save keeps them for seconds, one per span)."""
        for event in self._events.values():
            event.synchronize()
        self._events.clear()
        # One conversion per device table, then plain list slices: a tensor op per span
        # (1745 of them on GPT-2 large) let the program's thread take the GIL at each one.
        text = {device: hex_rows(host.numpy()) for device, host in self._host.items()}
        return [tuple(text[d][f : f + c]) for d, f, c in zip(self.devices, self.first, self.counts)]


class KnownChunks(Mapping[str, str]):
    """Device hash -> stored digest (chunk name), for every chunk of a manifest that has a
    device hash; a later chunk with the same hash wins.

    Built after every commit on the writer thread, so it indexes hashes with C loops and
    makes a chunk's name only when it is looked up: a fast span's names are made from its
    runs (storage/fast_chunks.py), and a save that changed every chunk looks none up.
    ``keys()`` is a dict's: membership there costs no Python call."""

    def __init__(self, manifest: Manifest) -> None:
        self._entries = [e for e in manifest.storages if e.hashes is not None]
        self._starts = [0, *accumulate(len(e.hashes) for e in self._entries)]  # type: ignore[arg-type]
        self._where = dict(zip(chain.from_iterable(e.hashes for e in self._entries), count()))  # type: ignore[misc]

    def __getitem__(self, device_hash: str) -> str:
        at = self._where[device_hash]
        e = bisect_right(self._starts, at) - 1
        return self._entries[e].chunks[at - self._starts[e]]

    def __contains__(self, device_hash: object) -> bool:
        return device_hash in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def keys(self) -> KeysView[str]:
        return self._where.keys()


def known_chunks(manifest: Manifest) -> KnownChunks:
    """Device hash -> stored digest, for every chunk of ``manifest`` that has a device hash."""
    return KnownChunks(manifest)


def unchanged_chunks(hashes: Sequence[str], known: Mapping[str, str]) -> dict[int, str]:
    """Chunk index -> stored digest, for the chunks whose bytes are already stored."""
    stored = known.keys()  # (a dict's keys: a C lookup per chunk)
    return {k: known[h] for k, h in enumerate(hashes) if h in stored}
