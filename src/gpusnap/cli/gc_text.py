"""What ``gpusnap gc`` prints: what it deleted and compacted, then its notes and problems."""

from __future__ import annotations

from collections.abc import Iterator

from gpusnap.cli.render import human_bytes
from gpusnap.storage.repository import GcReport

__all__ = ["gc_lines"]


def gc_lines(report: GcReport, *, fast: bool = False) -> Iterator[str]:
    """Lines for stdout; a corrupt chunk compaction met is a ``CORRUPT:`` line, as in verify."""
    if fast:
        yield (
            f"deleted {len(report.deleted_checkpoints)} checkpoint(s) from the fast tier; their slab bytes are "
            "free for the next saves (slab files are kept for reuse, not deleted)"
        )
    else:
        yield (
            f"deleted {len(report.deleted_checkpoints)} checkpoint(s) and {len(report.deleted_packs)} pack(s), "
            f"freed {human_bytes(report.freed_bytes)}"
        )
    if report.compacted_packs:
        yield (
            f"compacted {len(report.compacted_packs)} mostly dead pack(s) into {len(report.written_packs)}: "
            f"rewrote {human_bytes(report.rewritten_bytes)} of live chunks, "
            f"freed {human_bytes(report.compacted_bytes)} (counted above)"
        )
    for note in report.notes:
        yield f"note: {note}"
    for problem in report.problems:
        yield f"CORRUPT: {problem}"
