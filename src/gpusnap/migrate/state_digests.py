"""Per-chunk digests of a running program's state, taken at a round's consistent point, and
the chunks that changed between two such takes: what the fast handoff moves.

``precopy()`` takes them just before its round's ``save()`` on the caller's thread, so both
see the state at one point: a CUDA span is hashed by the device hash (``kernels.chunk_hash``,
enqueued on the current stream, the host does not wait; the round's save is enqueued after
it), a CPU span by BLAKE2b-128 now. ``handoff()`` takes them again and compares: a chunk
whose digest differs changed since that round. The digests are of the bytes, so a tensor the
program re-allocated meanwhile (or a ``state_dict()`` that builds fresh tensors, as RNG state
does) moves what differs, like any other. Two takes are comparable only when the state is
laid out alike: the same spans, in order, of the same lengths and devices on the same paths
(:attr:`Digests.layout`), which is what maps a span to the target's tensors.

>>> import torch
>>> from gpusnap.state.flatten import flatten
>>> state = {"w": torch.zeros(64)}
>>> before = take(flatten(state), 64)
>>> state["w"][20] = 1.0                       # bytes 80..84: chunk 1 of 4
>>> changed_runs(before, take(flatten(state), 64))
[Run(span=0, start=64, stop=128)]
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import torch

from gpusnap.kernels.chunk_hash import HASH_WORDS, num_chunks
from gpusnap.kernels.chunk_hash_many import chunk_hashes_many
from gpusnap.state.flat import FlatState

__all__ = ["CPU_BYTES_MAX", "Digests", "Run", "changed_runs", "take", "with_whole_spans"]

# The CPU bytes a take hashes at most (BLAKE2b on the caller's thread, ~1 GB/s): a GPU
# program's CPU state is its RNG state and counters; a state with more goes the general way
CPU_BYTES_MAX = 64 << 20


@dataclass(frozen=True)
class Run:
    """Bytes ``[start, stop)`` of span ``span``: consecutive changed chunks."""

    span: int
    start: int
    stop: int


@dataclass(frozen=True, eq=False)
class Digests:
    """One take: ``layout`` (comparable between takes), the chunk size, and the digest rows
    (int64 ``(chunks, 2)``) of each device's spans in one block (``blocks``: the device, its
    span indices, their rows in order: device hashes on a CUDA device, BLAKE2b-128 words on
    the host). ``rows[i]`` is span ``i``'s part of its block. Holds no storage of the state."""

    layout: Hashable
    chunk_size: int
    blocks: tuple[tuple[torch.device, tuple[int, ...], torch.Tensor], ...]
    rows: tuple[torch.Tensor, ...]


def take(flat: FlatState, chunk_size: int) -> Digests | None:
    """The digests of ``flat``'s spans now; None when its CPU spans hold more than
    :data:`CPU_BYTES_MAX` (or a span lies on a device that is neither CPU nor CUDA)."""
    spans = flat.spans
    if any(sp.device.type not in ("cpu", "cuda") for sp in spans):
        return None
    if sum(sp.nbytes for sp in spans if sp.device.type == "cpu") > CPU_BYTES_MAX:
        return None
    by_device: dict[torch.device, list[int]] = {}
    for i, sp in enumerate(spans):
        by_device.setdefault(sp.device, []).append(i)
    rows: list[torch.Tensor | None] = [None] * len(spans)
    blocks = []
    for device, indices in by_device.items():
        views = [spans[i].as_bytes() for i in indices]
        counts = [num_chunks(v.numel(), chunk_size) for v in views]
        if device.type == "cpu":
            out = torch.cat([_blake_rows(v, chunk_size) for v in views]) if views else torch.empty((0, HASH_WORDS),
                                                                                                   dtype=torch.int64)
        else:
            with torch.cuda.device(device):
                out = torch.empty((sum(counts), HASH_WORDS), dtype=torch.int64, device=device)
                chunk_hashes_many(views, chunk_size, out)
        row = 0
        for i, count in zip(indices, counts):
            rows[i] = out[row : row + count]
            row += count
        blocks.append((device, tuple(indices), out))
    layout = tuple((str(sp.device), sp.nbytes, tuple(sp.paths)) for sp in spans)
    return Digests(layout, chunk_size, tuple(blocks), tuple(r for r in rows if r is not None))


def changed_runs(base: Digests, now: Digests) -> list[Run] | None:
    """The runs of chunks that differ from ``base`` to ``now``, in span order; None when the
    two are not comparable (laid out otherwise, or another chunk size). One comparison and
    one copy to the host per device (the host waits for ``now``'s device hashes there)."""
    if base.layout != now.layout or base.chunk_size != now.chunk_size:
        return None
    cs = now.chunk_size
    flags: dict[int, np.ndarray] = {}
    for (_, indices, old), (_, _, new) in zip(base.blocks, now.blocks):
        differ = (old != new).any(dim=1).cpu().numpy()
        row = 0
        for i in indices:
            n = now.rows[i].shape[0]
            flags[i] = differ[row : row + n]
            row += n
    runs: list[Run] = []
    for i in range(len(now.rows)):
        nbytes = now.layout[i][1]  # type: ignore[index]
        for j0, j1 in _true_runs(flags[i]):
            runs.append(Run(i, j0 * cs, min(j1 * cs, nbytes)))
    return runs


def with_whole_spans(runs: list[Run], whole: list[int], nbytes: list[int]) -> list[Run]:
    """``runs`` with each span of ``whole`` (indices) as one run of all its bytes, in span order."""
    if not whole:
        return runs
    spans = set(whole)
    out = [r for r in runs if r.span not in spans] + [Run(i, 0, nbytes[i]) for i in sorted(spans) if nbytes[i]]
    return sorted(out, key=lambda r: (r.span, r.start))


def _true_runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """``[start, stop)`` of each run of True in ``flags``."""
    if not flags.any():
        return []
    padded = np.concatenate(([False], flags.astype(bool), [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    return [(int(a), int(b)) for a, b in zip(edges[0::2], edges[1::2])]


def _blake_rows(data: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """BLAKE2b-128 of each chunk of host bytes ``data``, as int64 rows ``(chunks, 2)``."""
    view = memoryview(data.numpy()) if data.numel() else memoryview(b"")
    digests = b"".join(hashlib.blake2b(view[a : a + chunk_size], digest_size=16).digest()
                       for a in range(0, len(view), chunk_size))
    return torch.from_numpy(np.frombuffer(digests, dtype=np.int64).reshape(-1, HASH_WORDS).copy())


def blake_hex(data: torch.Tensor, chunk_size: int) -> list[str]:
    """The hex digests :func:`_blake_rows` takes, one per chunk (what a target checks)."""
    view = memoryview(data.numpy()) if data.numel() else memoryview(b"")
    return [hashlib.blake2b(view[a : a + chunk_size], digest_size=16).hexdigest()
            for a in range(0, len(view), chunk_size)]
