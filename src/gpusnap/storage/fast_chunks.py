"""A fast-tier span's chunks held as runs of slab bytes: the compact record of a fast manifest.

A fast chunk is named ``<nh128 hex>@<slab>:<offset>:<length>`` (storage/fast_tier.py). A save
lays a span's chunks out back to back in slab memory, so a span's names come down to a few
*runs*: ``(slab, offset, count)``, chunks ``k .. k + count - 1`` of the span at ``offset +
j * chunk_size`` of that slab, each ``chunk_size`` bytes but the span's last (``nbytes`` ends
it). A manifest of :data:`~gpusnap.storage.manifest.FAST_VERSION` stores such a span as its
runs and its device hashes packed in one hex string (``{"runs": [[slab, offset, count], ...],
"hashes": "<32 hex digits a chunk>"}``) instead of two strings per chunk.

:class:`FastChunks` is that record in memory. It is the ``chunks`` of a
:class:`~gpusnap.storage.manifest.StorageEntry`: whoever reads chunk names sees the same
names, in order (made on first use); the writer builds, encodes and maps it to used slab
ranges with no Python per chunk (that Python, on the writer thread, took the interpreter
lock from the training thread in the step that the save committed in).
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from itertools import accumulate, chain
from typing import Any, overload

import numpy as np

__all__ = ["HASH_HEX", "FastChunks", "chunk_location", "fast_name", "chunk_ranges", "merged_ranges", "span_runs"]

HASH_HEX = 32  # hex digits of one nh128 device hash
_NAME = re.compile(r"^([0-9a-f]{32})@(\d+):(\d+):(\d+)$")
_HEX = re.compile(r"^[0-9a-f]*$")

Run = tuple[int, int, int]  # (slab, offset, chunks)


def fast_name(device_hash: str, slab: int, offset: int, length: int) -> str:
    """A fast chunk's name: its device hash and where its bytes lie."""
    return f"{device_hash}@{slab}:{offset}:{length}"


def chunk_location(name: str) -> tuple[str, int, int, int]:
    """``(device hash, slab, offset, length)`` of a fast chunk name; IntegrityError if malformed."""
    m = _NAME.match(name)
    if m is None:
        from gpusnap.errors import IntegrityError

        raise IntegrityError(f"{name!r} is not a fast-tier chunk name")
    return m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))


class FastChunks(Sequence[str]):
    """The chunk names of one fast span, as runs (see the module docstring). Immutable.

    >>> c = FastChunks(("0" * 32, "1" * 32), ((3, 4096, 2),), nbytes=1536, chunk_size=1024)
    >>> list(c) == ["0" * 32 + "@3:4096:1024", "1" * 32 + "@3:5120:512"]
    True
    >>> c.ranges()
    [(3, 4096, 5632)]
    """

    __slots__ = ("_names", "_starts", "chunk_size", "hashes", "nbytes", "runs")

    hashes: tuple[str, ...]
    runs: tuple[Run, ...]
    nbytes: int
    chunk_size: int

    def __init__(self, hashes: tuple[str, ...], runs: tuple[Run, ...], *, nbytes: int, chunk_size: int) -> None:
        # (not checked here: the writer makes thousands a save from what it placed itself;
        # what a file says is checked by from_json, see check())
        self.hashes = hashes
        self.runs = runs
        self.nbytes = nbytes
        self.chunk_size = chunk_size
        self._names: tuple[str, ...] | None = None
        self._starts: list[int] | None = None  # each run's first chunk

    def check(self) -> FastChunks:
        """Itself, if consistent (one hash and one place per chunk); else ValueError."""
        cs, nbytes = self.chunk_size, self.nbytes
        if cs <= 0 or nbytes < 0:
            raise ValueError(f"a fast span needs chunk_size > 0 and nbytes >= 0, got {cs} and {nbytes}")
        want, placed = -(-nbytes // cs), sum(r[2] for r in self.runs)
        if len(self.hashes) != want or placed != want:
            raise ValueError(
                f"a fast span of {nbytes} bytes has {want} chunk(s) of {cs} bytes; its record names "
                f"{len(self.hashes)} hash(es) and {placed} chunk(s) in runs"
            )
        if any(slab < 0 or offset < 0 or count < 1 for slab, offset, count in self.runs):
            raise ValueError(f"a fast span's runs must be (slab >= 0, offset >= 0, chunks >= 1), got {self.runs!r:.200}")
        return self

    # -- the names ---------------------------------------------------------------------------
    def names(self) -> tuple[str, ...]:
        """Every chunk's name, in order (made once, then kept)."""
        if self._names is None:
            cs, names, k = self.chunk_size, [], 0
            for slab, offset, count in self.runs:
                for j in range(count):
                    n = min(cs, self.nbytes - (k + j) * cs)
                    names.append(f"{self.hashes[k + j]}@{slab}:{offset + j * cs}:{n}")
                k += count
            self._names = tuple(names)
        return self._names

    def name(self, k: int) -> str:
        """Chunk ``k``'s name, without making the others'."""
        if self._names is not None:
            return self._names[k]
        if not 0 <= k < len(self.hashes):
            raise IndexError(f"chunk {k} of a span of {len(self.hashes)}")
        if self._starts is None:
            self._starts = [0, *accumulate(r[2] for r in self.runs)][:-1]
        r = bisect_right(self._starts, k) - 1
        slab, offset, _count = self.runs[r]
        cs = self.chunk_size
        return f"{self.hashes[k]}@{slab}:{offset + (k - self._starts[r]) * cs}:{min(cs, self.nbytes - k * cs)}"

    def __len__(self) -> int:
        return len(self.hashes)

    @overload
    def __getitem__(self, k: int) -> str: ...
    @overload
    def __getitem__(self, k: slice) -> tuple[str, ...]: ...
    def __getitem__(self, k: int | slice) -> str | tuple[str, ...]:
        if isinstance(k, slice):
            return self.names()[k]
        return self.name(k if k >= 0 else k + len(self.hashes))

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __eq__(self, other: object) -> bool:  # (the same names: a tuple of them is equal too)
        if isinstance(other, FastChunks):
            return self.names() == other.names()
        if isinstance(other, tuple):
            return self.names() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.names())

    def __repr__(self) -> str:
        return f"FastChunks({len(self.hashes)} chunks in {len(self.runs)} run(s) of {self.nbytes} bytes)"

    def __getstate__(self) -> dict[str, Any]:
        return {"hashes": self.hashes, "runs": self.runs, "nbytes": self.nbytes, "chunk_size": self.chunk_size}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)
        self._names = self._starts = None

    # -- what the writer needs in bulk ---------------------------------------------------------
    def ranges(self) -> list[tuple[int, int, int]]:
        """``(slab, lo, hi)``: the slab bytes each run covers."""
        cs, out, k = self.chunk_size, [], 0
        for slab, offset, count in self.runs:
            k += count
            out.append((slab, offset, offset + min(count * cs, self.nbytes - (k - count) * cs)))
        return out

    def to_json(self) -> dict[str, Any]:
        """The record's fields of its storage entry (beside ``nbytes`` and ``device``)."""
        return {"runs": [list(r) for r in self.runs], "hashes": "".join(self.hashes)}

    @classmethod
    def from_json(cls, doc: dict[str, Any], *, nbytes: int, chunk_size: int) -> FastChunks:
        """The record of a storage entry's ``runs`` and ``hashes``; ValueError/TypeError if malformed."""
        blob, runs_doc = doc["hashes"], doc["runs"]
        if not isinstance(blob, str) or not isinstance(runs_doc, list):
            raise TypeError("a fast span's hashes must be a string and its runs a list")
        if len(blob) % HASH_HEX or not _HEX.match(blob):
            raise ValueError(f"a fast span's hashes must be {HASH_HEX} lowercase hex digits a chunk")
        runs = []
        for r in runs_doc:
            if not isinstance(r, list) or len(r) != 3 or not all(type(x) is int for x in r):
                raise ValueError(f"a fast span's run must be [slab, offset, chunks], got {r!r:.80}")
            runs.append((r[0], r[1], r[2]))
        hashes = tuple(blob[i : i + HASH_HEX] for i in range(0, len(blob), HASH_HEX))
        return cls(hashes, tuple(runs), nbytes=nbytes, chunk_size=chunk_size).check()


def span_runs(slabs: np.ndarray, offsets: np.ndarray, first: Sequence[int], counts: Sequence[int],
              chunk_size: int) -> list[tuple[Run, ...]]:
    """The runs of every span of one save, from where each chunk lies (``slabs[g]``,
    ``offsets[g]`` of chunk ``g``; span ``i``'s chunks are ``first[i] .. first[i] +
    counts[i] - 1``), found with a few array operations for the whole save."""
    total = len(slabs)
    first_a = np.asarray(first, dtype=np.int64)
    counts_a = np.asarray(counts, dtype=np.int64)
    if not total:
        return [() for _ in counts]
    start = np.ones(total, dtype=bool)  # where a run starts: a new slab, a gap, a new span
    start[1:] = (slabs[1:] != slabs[:-1]) | (offsets[1:] != offsets[:-1] + chunk_size)
    start[first_a[counts_a > 0]] = True
    at = np.flatnonzero(start)
    runs = np.stack([slabs[at], offsets[at], np.diff(at, append=total)], axis=1).tolist()
    lo = np.searchsorted(at, first_a).tolist()
    hi = np.searchsorted(at, first_a + counts_a).tolist()
    return [tuple(map(tuple, runs[a:b])) for a, b in zip(lo, hi)]  # type: ignore[misc]


_SLAB_SPAN = 1 << 40  # slab s's bytes map to [s << 40, (s + 1) << 40): one sorted line for every slab


def merged_ranges(records: Sequence[FastChunks]) -> dict[int, list[tuple[int, int]]]:
    """Slab -> the sorted, merged byte ranges ``[lo, hi)`` that ``records`` cover (ranges
    that overlap or touch are one), with a few array operations for all of them."""
    runs = list(chain.from_iterable(r.runs for r in records))
    if not runs:
        return {}
    table = np.array(runs, dtype=np.int64).reshape(-1, 3)
    slabs, los = table[:, 0], table[:, 1]
    his = los + table[:, 2] * np.fromiter((r.chunk_size for r in records for _ in r.runs), dtype=np.int64,
                                          count=len(runs))
    # a span's last chunk is short by what its bytes lack of whole chunks: off its last run
    per = np.fromiter(map(len, (r.runs for r in records)), dtype=np.int64, count=len(records))
    short = np.fromiter((len(r.hashes) * r.chunk_size - r.nbytes for r in records), dtype=np.int64, count=len(records))
    his[(np.cumsum(per) - 1)[per > 0]] -= short[per > 0]
    return chunk_ranges(slabs, los, his - los)


def chunk_ranges(slabs: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> dict[int, list[tuple[int, int]]]:
    """Slab -> the sorted, merged byte ranges of chunks ``g`` at ``offsets[g]`` of slab
    ``slabs[g]``, ``sizes[g]`` bytes long (as :func:`merged_ranges`), in array operations."""
    if not len(slabs):
        return {}
    line_lo, line_hi = slabs * _SLAB_SPAN + offsets, slabs * _SLAB_SPAN + offsets + sizes
    order = np.argsort(line_lo, kind="stable")
    line_lo, line_hi = line_lo[order], line_hi[order]
    reach = np.maximum.accumulate(line_hi)
    start = np.ones(len(line_lo), dtype=bool)
    start[1:] = line_lo[1:] > reach[:-1]
    at = np.flatnonzero(start)
    lo, hi = line_lo[at], np.maximum.reduceat(line_hi, at)
    out: dict[int, list[tuple[int, int]]] = {}
    for slab, a, b in zip((lo // _SLAB_SPAN).tolist(), (lo % _SLAB_SPAN).tolist(), (hi - lo // _SLAB_SPAN * _SLAB_SPAN).tolist()):
        out.setdefault(slab, []).append((a, b))
    return out
