"""Where a fast tier's bytes lie: its slab files' names, how saves' regions are aligned and
rounded, and sets of slab ranges (merged, from manifests). Shared by the tier, its
transactions, its verify and its tools."""

from __future__ import annotations

import builtins
from dataclasses import dataclass

from gpusnap.storage.fast_chunks import FastChunks, merged_ranges
from gpusnap.storage.manifest import Manifest

__all__ = ["ALIGN", "SLABS", "SLAB_ROUND", "Extent", "add_ranges", "merge_ranges", "room_needed", "slab_path"]

SLABS = "slabs"
SLAB_ROUND = 2 << 20  # slab sizes are whole 2 MiB (huge-page friendly)
ALIGN = 4096  # each region starts on a page: DMA-friendly, and no two saves share a page


def slab_path(slab: int) -> str:
    """Slab ``slab``'s file, relative to the fast root."""
    return f"{SLABS}/{slab:06d}.slab"


def room_needed(span_bytes: builtins.list[int], piece: int) -> int:
    """Slab bytes one save may take: every span's bytes, each region page-aligned, plus the
    tail of a reserved extent that a piece did not fit in (``FastTier.reserve`` adds it)."""
    pieces = sum(-(-n // piece) for n in span_bytes if n)
    return sum(span_bytes) + pieces * ALIGN


@dataclass
class Extent:
    """Reserved slab bytes ``[lo, hi)`` a save carves its regions from (``cursor`` onward)."""

    slab: int
    lo: int
    hi: int
    cursor: int


def add_ranges(used: dict[int, builtins.list[tuple[int, int]]], manifest: Manifest) -> None:
    """Add the slab ranges ``manifest``'s chunks lie in to ``used`` (slab -> ranges, unmerged)."""
    records = [e.chunks for e in manifest.storages if isinstance(e.chunks, FastChunks)]
    for slab, ranges in merged_ranges(records).items():  # (array operations over every run)
        used.setdefault(slab, []).extend(ranges)
    for entry in manifest.storages:
        if isinstance(entry.chunks, FastChunks):
            continue
        for name in entry.chunks:  # (a manifest of format version 1)
            try:  # (split, not chunk_location's regex: a manifest has thousands of chunks)
                slab_s, off_s, n_s = name[name.index("@") + 1 :].split(":")
                slab, off, n = int(slab_s), int(off_s), int(n_s)
            except ValueError:
                continue  # (not a fast chunk's name: it names no slab bytes)
            used.setdefault(slab, []).append((off, off + n))


def merge_ranges(ranges: builtins.list[tuple[int, int]]) -> builtins.list[tuple[int, int]]:
    """``ranges`` sorted, overlapping or touching ones joined."""
    out: builtins.list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
