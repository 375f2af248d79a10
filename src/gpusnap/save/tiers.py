"""Where a Checkpointer's checkpoints live: the durable root and the optional fast tier.

Opens each root on first use (a save makes this Checkpointer its one writer), finds a
checkpoint by id or tag across both (the fast tier first), lists them, applies retention
after a commit, and owns the promoter that copies fast checkpoints to the durable root.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from gpusnap.config import Config
from gpusnap.distributed.collective import Collective
from gpusnap.errors import CheckpointError, CheckpointNotFoundError, StorageError
from gpusnap.handles import CheckpointInfo
from gpusnap.save.memory_tier import MemoryTierChoice, durable_identity, refused
from gpusnap.save.promotion import Promoter
from gpusnap.storage.fast_tier import FastTier
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.repository import Repository

__all__ = ["Tiers", "durable_identity", "info_from_manifest"]

log = logging.getLogger("gpusnap")


def info_from_manifest(manifest: Manifest, tier: str = "durable") -> CheckpointInfo:
    return CheckpointInfo(
        id=manifest.id,
        tag=manifest.tag,
        created=manifest.created,
        nbytes=manifest.nbytes,
        stats=dict(manifest.stats),
        tier=tier,
        world_size=manifest.world_size,
    )


def tier_name(repo: Repository) -> str:
    return "fast" if isinstance(repo, FastTier) else "durable"


class Tiers:
    def __init__(self, root: str, fast_root: str | None, *, keep_last: int | None, fast_keep_last: int,
                 promote_every: int | None, config: Config, storage_options: dict[str, Any] | None,
                 collective: Collective | None, on_new_fast: Callable[[], None],
                 memory: MemoryTierChoice | None = None) -> None:
        """``on_new_fast()`` is called whenever a fast tier is made (its chunk names are new).
        ``memory``: the default path's choice of memory tier; when it has a path, ``fast_root``
        is that path, a tier this Checkpointer owns (adopted, emptied and removed by it)."""
        self.root, self.fast_root = root, fast_root
        self.memory = memory if memory is not None else MemoryTierChoice(None)
        self.implicit = self.memory.path is not None and fast_root == self.memory.path
        self.keep_last, self.fast_keep_last, self.promote_every = keep_last, fast_keep_last, promote_every
        self.config = config
        self.collective = collective
        self._storage_options = storage_options
        self._on_new_fast = on_new_fast
        self._repo: Repository | None = None
        self._fast: FastTier | None = None
        self._lock = threading.Lock()
        self.promoter: Promoter | None = None  # made at the first promotion
        self._fast_commits = 0  # committed to the fast tier (promote_every counts these)
        self.opened: list[Repository] = []  # every root opened (let go when the Checkpointer is collected)

    # -- opening -------------------------------------------------------------------------
    def durable(self, *, create: bool) -> Repository:
        """The root; ``create`` (saving) also makes this Checkpointer its one writer until
        ``close()``: a StorageError names the writer that already holds it."""
        with self._lock:
            if self._repo is None and self.collective is not None:  # (this rank's own root)
                self._repo = repo = self.collective.rank_repository()
                self.opened.append(repo)
            if self._repo is None:
                self._repo = repo = Repository.open(
                    self.root, create=create, storage_options=self._storage_options, config=self.config)
                self.opened.append(repo)
            if create and isinstance(self._repo, FastTier):  # (reading one is fine)
                raise CheckpointError(
                    f"{self.root} is a fast tier's root; a Checkpointer's root is durable: give it its own directory "
                    "(and pass the fast tier as fast_root)"
                )
            if create:
                self._repo.claim_writer()  # idempotent
                if self.collective is not None:
                    self.collective.announce()
            return self._repo

    def fast(self) -> FastTier:
        """The fast tier (created on first use), with this Checkpointer its one writer."""
        with self._lock:
            if self._fast is not None and not self._fast.intact():
                # removed under us (a cleaned /dev/shm): start a new one there; the old one's
                # lease and maps go (saves still holding its transactions fail on their own)
                log.warning("gpusnap: the fast tier %s was removed; a new one is made there", self.fast_root)
                self.opened.remove(self._fast)
                if self.promoter is not None:  # its promotions still read the old tier's maps
                    self.promoter.retire(self._fast)
                else:
                    self._fast.close()
                self._fast = None
            if self._fast is None:
                assert self.fast_root is not None
                self._fast = FastTier.open(self.fast_root, create=True, config=self.config,
                                           durable_root=self.durable_identity())
                self.opened.append(self._fast)
                self._on_new_fast()
                made = self._fast
            else:
                made = None
            self._fast.claim_writer()
            fast = self._fast
        if made is not None and self.implicit:  # (outside the lock: it opens the durable root)
            self._adopt(made)
        return fast

    @property
    def saves_to_fast(self) -> bool:
        """Whether saves commit to the fast tier: an explicit one, or the memory tier unless
        it is off or was refused (then a tier an earlier process left is only read)."""
        return self.fast_root is not None and (not self.implicit or self.memory.saves_here)

    def adopt_left(self) -> None:
        """A memory tier left by an earlier process, not opened yet: opened as its writer
        (which makes its newest checkpoint durable), unless another process writes it."""
        if not self.implicit or self._fast is not None or not os.path.isdir(str(self.fast_root)):
            return
        try:
            self.fast()
        except CheckpointError as exc:  # (a live process of the same root holds it: its own to promote)
            log.info("gpusnap: the memory tier %s is not adopted: %s", self.fast_root, exc)

    def _adopt(self, tier: FastTier) -> None:
        """A memory tier a process left (it crashed, or was killed) may hold a checkpoint newer
        than the root's newest: that one is made durable now."""
        try:
            newest = self._newer_than_root(tier)
        except (CheckpointError, OSError) as exc:
            log.warning("gpusnap: could not look into the memory tier %s left by an earlier process: %s",
                        self.fast_root, exc)
            return
        if newest is None:
            return  # (the root has it, or something newer)
        log.warning("gpusnap: the memory tier %s holds checkpoint %s, which never reached %s (its process ended "
                    "first): it is made durable now", self.fast_root, newest.id, self.root)
        self.promotions().submit(tier, newest, explicit=True)

    def _newer_than_root(self, tier: FastTier) -> Manifest | None:
        """``tier``'s newest checkpoint if it is newer than the durable root's newest, else None."""
        held = tier.list()
        if not held:
            return None
        durable = self.durable(create=True).list()
        newest = held[-1]
        if durable and (newest.created, newest.id) <= (durable[-1].created, durable[-1].id):
            return None
        return newest

    def memory_note(self) -> str:
        """``stats["memory_tier"]``: on (where), or off and why."""
        if self.implicit:
            return self.memory.note
        return "explicit fast_root" if self.fast_root is not None else self.memory.note

    def bound_fast(self, tier: FastTier, need: int, piece: int) -> bool:
        """Bound the fast tier to this state's saves. Where its file system cannot hold them,
        an explicit tier raises the StorageError; the memory tier is turned off for good
        (WARNING once) and this returns False: this and later saves go to the root."""
        if not self.implicit:
            tier.set_budget(self.fast_saves_held(), need, piece)
            return True
        try:
            tier.set_budget(self.fast_saves_held(), need, piece)
            return True
        except StorageError as exc:  # (what it holds stays listed, and its newest is made durable at close)
            self.memory = refused(f"the memory tier {self.fast_root} has no room for this state: {exc}",
                                  self.memory.path)
            return False

    def fast_saves_held(self) -> int:
        """Checkpoints the fast tier has room for: those kept, the one being written, and one
        more (a promotion in flight holds one past retention; room lost between regions)."""
        return self.fast_keep_last + 2

    def durable_identity(self) -> str:
        """How a fast root records the durable root it belongs to (a local one by its real path)."""
        return durable_identity(self.root)

    def promotions(self) -> Promoter:
        if self.promoter is None:
            self.promoter = Promoter(lambda: self.durable(create=True), threads=self.config.io_threads,
                                     config=self.config,
                                     on_promoted=lambda repo, _m: self.retain(repo, self.keep_last),
                                     on_released=lambda tier: self.retain(tier, self.fast_keep_last))
        return self.promoter

    # -- finding -------------------------------------------------------------------------
    def existing(self) -> list[Repository]:
        """The roots that exist: the fast tier first (it is read first), then the durable one."""
        tiers: list[Repository] = []
        if self.collective is not None:  # its checkpoints: the global manifests
            try:
                return [self.collective.root_repository(create=False)]
            except CheckpointNotFoundError:
                return []
        if self.fast_root is not None:
            try:
                tiers.append(self._fast if self._fast is not None else FastTier.open(
                    self.fast_root, config=self.config, durable_root=self.durable_identity()))
            except CheckpointNotFoundError:
                pass
        try:
            tiers.append(self.durable(create=False))
        except CheckpointNotFoundError:
            pass
        return tiers

    def resolve(self, ref: str | None) -> tuple[Repository, Manifest, list[Any]]:
        """Where ``ref`` (id, tag, None: the newest across tiers) is read from: the fast tier
        when it holds it, else the durable root; and the unreadable newer manifests skipped."""
        tiers = self.existing()
        if not tiers:
            where = self.root if self.fast_root is None else f"{self.root} or {self.fast_root}"
            raise CheckpointNotFoundError(f"no checkpoint root at {where} (nothing has been saved there yet)")
        best: tuple[Repository, Manifest, list[Any]] | None = None
        errors: list[CheckpointNotFoundError] = []
        for repo in tiers:
            try:
                manifest, skipped = repo.resolve_reporting(ref)
            except CheckpointNotFoundError as exc:
                errors.append(exc)
                continue
            if ref is not None:
                return repo, manifest, skipped
            if best is None or (manifest.created, manifest.id) > (best[1].created, best[1].id):
                best = (repo, manifest, skipped)
        if best is None:  # each tier's words: each names the tags it holds
            raise errors[0] if len(errors) == 1 else CheckpointNotFoundError("; ".join(map(str, errors)))
        return best

    def infos(self) -> list[CheckpointInfo]:
        """Committed checkpoints of both tiers, oldest first; one in both lists as durable."""
        found: dict[str, CheckpointInfo] = {}
        for repo in self.existing():
            manifests, unreadable = repo.scan()
            repo.warn_unreadable(unreadable, "list() and latest() leave it out")  # once per file
            tier = tier_name(repo)
            for m in manifests:
                if m.id not in found or tier == "durable":
                    found[m.id] = info_from_manifest(m, tier)
        return sorted(found.values(), key=lambda i: (i.created, i.id))

    def tag_owner(self, tag: str) -> str | None:
        """The committed checkpoint ``tag`` names in either tier, if any."""
        if self.collective is not None:
            owner = self.collective.tag_owner(tag)
        else:
            owner = self.durable(create=True).tag_owner(tag)
        if owner is None and self.fast_root is not None:
            owner = self.fast().tag_owner(tag)
        return owner

    # -- after a commit, deleting -----------------------------------------------------------
    def after_fast_commit(self, tier: FastTier, manifest: Manifest, *, promote: bool, keep: object = None) -> bool:
        """Queue the promotion due (every ``promote_every``-th commit, or ``promote``), then
        apply the fast tier's retention; True when a promotion was queued. ``keep`` stays
        alive until the promotion is over (what the exit hooks track)."""
        self._fast_commits += 1
        # the memory tier keeps one checkpoint: a tagged one is always promoted, and never
        # replaced by a newer save's promotion, or its tag would name nothing once retention
        # dropped it
        explicit = promote or (self.implicit and manifest.tag is not None)
        due = explicit or (self.promote_every is not None and self._fast_commits % self.promote_every == 0)
        if due:  # pinned before retention can drop it
            self.promotions().submit(tier, manifest, explicit=explicit, keep=keep)
        self.retain(tier, self.fast_keep_last)
        return due

    def retain(self, repo: Repository, keep_last: int | None, *, sweep: bool = False) -> None:
        """``keep_last`` after a commit, even while the next save writes (Repository.gc pins
        what its transaction relies on). It never fails the save that just committed: an
        error is a WARNING, and the next commit tries again. ``sweep``: free the packs nothing
        references even without ``keep_last`` (after a delete). It never compacts: that
        rewrites packs, which would compete with the next save's writes (``gpusnap gc`` does)."""
        if keep_last is None and not sweep:
            return
        try:
            report = repo.gc(keep_last, blocking=False, fresh=False, compact=False)
        except Exception as exc:
            log.warning("gpusnap: retention (keep_last=%s) failed; the next commit tries again: %s",
                        keep_last, exc)
            return
        if report.skipped:  # only a reader (verify) or an older gpusnap holds the root lock
            log.info("gpusnap: retention skipped; the next commit tries again: %s", report.notes)
        repo.warn_unreadable(report.unreadable, "retention deletes no packs while it is unreadable, so the root grows")

    def delete(self, checkpoint: str) -> None:
        """Delete ``checkpoint`` (id or tag) from each tier that holds it, then sweep."""
        if self.promoter is not None:  # called off first: it must not commit it to the durable root after this
            self.promoter.cancel(checkpoint)
        tiers = [(self.durable(create=True), self.keep_last)]
        if self.fast_root is not None:
            tiers.append((self.fast(), self.fast_keep_last))
        found = False
        for repo, keep_last in tiers:
            try:
                manifest = repo.resolve(checkpoint)
            except CheckpointNotFoundError:
                continue
            repo.delete(manifest.id)
            self.retain(repo, keep_last, sweep=True)
            found = True
        if not found:
            raise CheckpointNotFoundError(f"no committed checkpoint {checkpoint!r} under {self.root}")

    def raise_promotion_failures(self) -> None:
        """The promotions that failed and have not succeeded since, once: their checkpoints
        were kept in the fast tier until now (fast retention applies to them again)."""
        failures = self.promoter.take_failures() if self.promoter is not None else []
        if failures:
            names = ", ".join(f"{f.checkpoint_id}" + (f" (tag {f.tag!r})" if f.tag else "") for f in failures)
            raise StorageError(
                f"promoting to the durable root {self.root} failed for {names}: they are not in {self.root}, "
                f"only in the fast tier {self.fast_root} (until its retention drops them): {failures[-1].error}"
            ) from failures[-1].error

    def report_promotion_failures(self, when: str) -> None:
        """Name on stderr each promotion that failed and nothing raised (the process ends)."""
        for f in self.promoter.take_failures() if self.promoter is not None else []:
            where = "in neither tier" if f.dropped else f"only in the fast tier {self.fast_root}"
            print(f"gpusnap: {when}, promoting checkpoint {f.checkpoint_id}"
                  + (f" (tag {f.tag!r})" if f.tag else "")
                  + f" to {self.root} failed; it is {where}: {type(f.error).__name__}: {f.error}",
                  file=sys.stderr, flush=True)

    def newest_not_durable(self) -> None:
        """The memory tier's newest checkpoint, unless the root has it or a promotion of it is
        under way, is promoted (close() and exit: the memory tier goes with the process)."""
        self.adopt_left()
        if not self.implicit or self._fast is None:
            return
        held = self._fast.list()
        if not held:
            return
        newest = held[-1]
        promoter = self.promoter
        if promoter is not None and newest.id in promoter.pending_ids() + promoter.failed_ids():
            return
        if newest.id in {i.id for i in self.durable(create=True).list()}:
            return
        self.promotions().submit(self._fast, newest, explicit=True)

    def close(self) -> None:
        """Release both roots' writer leases: another Checkpointer may write now. The memory
        tier is removed first when everything it holds that the root lacks is older than the
        root's newest checkpoint (nothing would be lost)."""
        if self.implicit and self._fast is not None:
            self._remove_memory_tier(self._fast)
        for repo in (self._repo, self._fast):
            if repo is not None:
                repo.close()

    def _remove_memory_tier(self, tier: FastTier) -> None:
        try:
            if self.promoter is not None and (self.promoter.pending_ids() or self.promoter.failed_ids()):
                return  # (its failures are raised: the checkpoints stay where they are)
            if self._newer_than_root(tier) is not None:
                return
            tier.remove_all()
        except (CheckpointError, OSError) as exc:
            log.warning("gpusnap: the memory tier %s could not be removed: %s", self.fast_root, exc)
