"""What a committed save's ``stats`` say about its capture window."""

from __future__ import annotations

from typing import Any

from gpusnap.capture.concurrent import ConcurrentSave
from gpusnap.capture.history import SKIP_WORTH

__all__ = ["incremental_note", "window_stats"]


def incremental_note(incremental: bool, share: float | None, compared: bool) -> str:
    """``stats["incremental"]``; ``share``: the bytes this save found unchanged (None: no
    checkpoint to compare with)."""
    if not incremental:
        return "off"
    if share is None:
        return "nothing to compare with"
    if compared:
        return f"compared with the latest checkpoint: {share:.1%} of the bytes unchanged"
    return (f"not compared (copied at once, as the previous save found less than {SKIP_WORTH:.0%} "
            f"unchanged); its hashes found {share:.1%} of the bytes unchanged")


def window_stats(capture: ConcurrentSave) -> dict[str, Any]:
    w = capture.window
    closed = w.closed_at if w.closed_at is not None else w.opened
    fast = _fast_stats(capture)
    return {
        "copies": capture.copier.copies,
        "copy_path": capture.copier.copy_path,  # "address" or "torch" (capture/address_copy.py)
        "copy_path_why": capture.copier.copy_path_why,
        "bytes_cow": w.stats.bytes_cow,
        "cow_events": w.stats.cow_events,
        "cow_failures": w.stats.cow_failures,  # shadows that found no memory: waited instead
        "waits": w.stats.waits,
        "wait_s": w.stats.wait_s,
        "window_s": closed - w.opened,
        "cow_peak_bytes": w.stats.cow_peak,
        "stream_waits": w.stats.stream_waits,
        "staging_bytes": capture.staging.nbytes,
        # the host memory this Checkpointer holds for saves: the fast tier's slabs, else the staging
        "host_memory_bytes": fast.get("fast_tier_bytes", capture.staging.nbytes),
        "staging_grow_s": capture.staging.grow_s,
        **fast,
        "ops_seen": w.stats.ops_seen,
        "opaque_launches": w.stats.opaque_launches,
        "program_copies": w.stats.program_copies,
        "bytes_eager": w.bytes_eager,
        "bytes_snapshot": w.bytes_snapshot,  # copied at save() on the program's streams
        "tracked": capture.tracked,  # whether the window needed the tracker
        # the copier's steps, seconds after save() opened the window, and its waits for copies
        "copier_s": {k: round(t - w.opened, 6) for k, t in capture.copier.marks.items()}
        | {"waiting": round(capture.copier.wait_s, 6)},
    }


def _fast_stats(capture: ConcurrentSave) -> dict[str, Any]:
    """A fast save's view of its tier's slab preparation (storage/slab_prep.py)."""
    if not capture.fast:
        return {}
    tier = capture.staging.txn.tier
    return {"fast_prepared_bytes": tier.prepared_bytes(),
            # the tier's host memory (slab files) and its bound: about (fast_keep_last + 2) x the state
            "fast_tier_bytes": tier.slab_bytes(), "fast_tier_cap_bytes": tier.capacity(),
            "fast_prepare_errors": tier.prepare_errors(),
            "fast_register_errors": list(tier.register_errors)}  # slabs copied through pageable memory
