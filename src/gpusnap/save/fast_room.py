"""Room in the fast tier for one save, reserved before its window opens."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpusnap.capture.fast_arena import room_needed
from gpusnap.errors import StorageError
from gpusnap.save.tiers import Tiers
from gpusnap.state.flatten import FlatState
from gpusnap.storage.fast_tier import FastTier

if TYPE_CHECKING:
    from gpusnap.storage.fast_tier import FastTxn

__all__ = ["reserve_fast"]

log = logging.getLogger("gpusnap")


def reserve_fast(tiers: Tiers, fast: FastTier, flat: FlatState, others_busy: Callable[[], bool]) -> FastTxn | None:
    """A fast-tier transaction with room for ``flat`` reserved, or None (``when_busy=
    "skip"`` and no room). ``"wait"`` waits while saves (``others_busy()``) or a promotion
    in flight may make room; with none in flight, no room is a StorageError that says what
    to change."""
    config = tiers.config
    need = room_needed([s.nbytes for s in flat.spans], config.piece_bytes())
    piece = min(config.piece_bytes(), need)  # (no piece of a save is larger than the save)
    fast.set_budget(tiers.fast_saves_held(), need, piece)
    retained = False
    while True:
        txn = fast.begin_write()
        try:
            if txn.reserve(need, piece):
                break
        except BaseException:
            txn.abort()
            raise
        txn.abort()  # (waiting without it: retention needs the root's lock exclusively)
        if config.when_busy == "skip":
            return None
        promoter = tiers.promoter
        if not others_busy() and not (promoter is not None and promoter.busy()):
            if not retained:  # a promotion that ended meanwhile may have left its checkpoint
                retained = True  # past fast_keep_last (its retention met this save's lock)
                tiers.retain(fast, tiers.fast_keep_last)
                continue
            if promoter is not None and promoter.let_go_oldest_failure() is not None:
                retained = False  # (a durable outage must not stop the fast tier: wait() raises it)
                continue
            held = promoter.pending_ids() + promoter.failed_ids() if promoter is not None else []
            raise StorageError(
                f"the fast tier {tiers.fast_root} has no room for this save ({need} bytes) beside the "
                f"{tiers.fast_keep_last} checkpoint(s) it keeps"
                + (f" and those kept for promotion ({', '.join(held)})" if held else "")
                + f" (it may hold {fast.capacity()} bytes): raise Config.fast_tier_bytes or lower fast_keep_last"
                + ("; wait() raises the failed promotions and lets them go" if held else "") + "; nothing was saved"
            )
        retained = False
        fast.wait_for_change(0.05)  # a save commits or aborts, retention or a promotion ends
    try:
        # room for every checkpoint the tier holds at once plus this one's successor,
        # made ready in the background (storage/slab_prep.py): later saves wait for no slab
        try:
            fast.prepare_for(tiers.fast_keep_last + 1, need, piece)
        except Exception as exc:  # (no thread to start, say): later saves prepare their own slabs
            log.warning("gpusnap: could not prepare fast-tier slabs ahead of use: %s", exc)
    except BaseException:
        txn.abort()
        raise
    return txn
