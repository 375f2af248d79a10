"""What a Checkpointer's saves learn from one another, in one place.

Each save is planned from what earlier ones saw: the flatten plan (the per-tensor work), the
order the program wrote spans in (written spans are copied first), the order it first read
them (a lazy restore loads in it), the latest checkpoint's chunk hashes (an incremental save
skips what they say is unchanged), the share of bytes the last save found unchanged (whether
comparing pays), and the tensors a custom kernel wrote unseen (captured at ``save()`` from
then on). The :class:`~gpusnap.Checkpointer` orchestrates; this object keeps that memory and
answers from it, and every save hands it what it learned.

>>> h = CaptureHistory(chunk_size=1 << 20)
>>> h.should_compare()  # nothing learned yet: compare
True
>>> h.learn_unchanged(0.01)
>>> h.should_compare()
False
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from gpusnap.capture.validation import known_chunks
from gpusnap.errors import CheckpointError
from gpusnap.state.flatten import FlatPlan, FlatState
from gpusnap.storage import Manifest

if TYPE_CHECKING:
    from gpusnap.capture.concurrent import ConcurrentSave
    from gpusnap.storage import Repository

__all__ = ["SKIP_WORTH", "CaptureHistory"]

# Incremental saves compare with the latest checkpoint only where it pays (should_compare):
SKIP_WORTH = 0.05  # when the last save found at least this share of the bytes unchanged


class CaptureHistory:
    """One Checkpointer's memory across saves (see the module docstring). Used by the thread
    that saves and the writer thread, one save at a time, as the Checkpointer was."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.flat_plan: FlatPlan | None = None  # the last save's per-tensor work (state/flatten.py)
        self.write_order: list[str] = []  # key paths, soonest-written first (last tracked window)
        self.access_paths: list[str] | None = None  # key paths in the first logged window's read order
        self.eager_paths: set[str] = set()  # written unseen once: captured at save() from now on
        self.unchanged_share: float | None = None  # of the last incremental save, compared or not
        self._previous: Mapping[str, str] | None = None  # latest checkpoint: device hash -> digest
        self._order_memo: tuple[FlatPlan | None, list[str], list[int]] | None = None  # plan, write order, copy order
        self._devices_memo: tuple[Any, list[torch.device], int] | None = None

    # -- planning a save ----------------------------------------------------------------------
    def copy_order(self, flat: FlatState) -> list[int]:
        """Spans the previous window saw written go first, soonest first; then the rest.

        The same as last time when this save reused the last flatten plan and no window
        learned a new write order since (a few ms of Python per thousand spans, every save)."""
        memo = self._order_memo
        if memo is not None and memo[0] is flat.plan and memo[1] is self.write_order:
            return memo[2]  # (a walk that did not reuse the plan made a new one)
        rank = {path: i for i, path in enumerate(self.write_order)}
        far = len(rank)
        keyed = [(min((rank.get(p, far) for p in s.paths), default=far), s.index) for s in flat.spans]
        order = [index for _, index in sorted(keyed)]
        self._order_memo = (flat.plan, self.write_order, order)
        return order

    def devices(self, flat: FlatState) -> tuple[list[torch.device], int]:
        """The CUDA devices of ``flat``'s spans, and its bytes off the CPU: the same as last
        time when this save reused the last flatten plan (a loop over every span, ~1 ms of
        save() on GPT-2 large, saved)."""
        memo = self._devices_memo
        if memo is not None and memo[0] is flat.plan:
            return memo[1], memo[2]
        cuda = sorted({s.device for s in flat.spans if s.device.type == "cuda"}, key=str)
        device_bytes = sum(s.nbytes for s in flat.spans if s.device.type != "cpu")
        self._devices_memo = (flat.plan, cuda, device_bytes)
        return cuda, device_bytes

    def eager_spans(self, flat: FlatState) -> list[int]:
        """Spans captured at save() because a write to them once went unseen."""
        if not self.eager_paths:
            return []
        return [sp.index for sp in flat.spans if self.eager_paths.intersection(sp.paths)]

    def logs_reads(self) -> bool:
        """Whether the next window should log the program's read order (once: the first)."""
        return self.access_paths is None

    def should_compare(self) -> bool:
        """Whether an incremental save compares its hashes with the latest checkpoint's
        before copying. Comparing makes the copier wait for the consistent point's hashes,
        which kept GPT-2 large training windows open twice as long with nothing unchanged
        (BENCHMARKS.md). Every incremental save learns the unchanged share
        from its hashes, compared or not (an uncompared one after its copies, for a dict
        lookup per chunk), so a save compares only when the previous one found at least
        :data:`SKIP_WORTH` of the bytes unchanged: training copies at once every time, and a
        workload that freezes its weights compares from the save after that."""
        share = self.unchanged_share
        return share is None or share >= SKIP_WORTH

    def previous_spans(self, repo: Repository) -> Mapping[str, str]:
        """Device hash -> stored digest of the latest checkpoint's chunks in ``repo``
        (incremental saves skip chunks found here)."""
        if self._previous is None:
            self._previous = {}
            try:
                latest = repo.resolve(None)
            except CheckpointError:
                latest = None
            if latest is not None and latest.chunk_size == self.chunk_size:
                self._previous = known_chunks(latest)
        return self._previous

    def forget_previous(self) -> None:
        """The latest checkpoint's hashes no longer apply (its chunks' root was replaced)."""
        self._previous = None

    # -- what a save teaches ------------------------------------------------------------------
    def learn_plan(self, flat: FlatState) -> None:
        self.flat_plan = flat.plan

    def learn_unchanged(self, share: float) -> None:
        self.unchanged_share = share

    def learn_window(self, capture: ConcurrentSave) -> list[int]:
        """After a window: its write order (a tracked window saw the writes) and the span
        indices in the order the program first read them (logged by the first window only;
        later saves map its key paths), which the manifest records for lazy restores."""
        window = capture.window
        if capture.tracked:  # an untracked window saw no writes: keep the order
            self.write_order = window.write_order()
        if window.log_reads and capture.tracked:
            order = window.access_order()
            self.access_paths = [window.spans[i].span.paths[0] for i in order if window.spans[i].span.paths]
            return order
        index = {p: s.index for s in capture.flat.spans for p in s.paths}
        return list(dict.fromkeys(index[p] for p in self.access_paths or () if p in index))

    def learn_unseen_writes(self, paths: list[str]) -> None:
        """Tensors a write the tracker did not see changed: captured at save() from now on."""
        self.eager_paths.update(paths)

    def learn_commit(self, manifest: Manifest) -> None:
        """A committed checkpoint with device hashes is the next incremental save's base."""
        if any(e.hashes is not None for e in manifest.storages):
            self._previous = known_chunks(manifest)
