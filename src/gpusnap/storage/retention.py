"""Retention: a repository's gc (old checkpoints, then unreferenced packs, then compaction,
then stale ``tmp/`` files) and its report.

:class:`Retention` is a part of :class:`~gpusnap.storage.repository.Repository` (a base
class it builds on, one idea per file); it relies on the repository's pins of open write
transactions (``Repository.pin``) so that a gc never deletes what a save relies on.
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpusnap.config import Config
from gpusnap.errors import StorageError
from gpusnap.storage.backend_protocol import Backend, BackendLock, poll_until
from gpusnap.storage.compact import Compaction, mostly_dead
from gpusnap.storage.compact import compact as compact_packs
from gpusnap.storage.compact import dead_bytes as pack_dead_bytes
from gpusnap.storage.layout import MANIFESTS, TMP, os_reason, storage_error
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.pack import PackIndex
from gpusnap.storage.unknown_ref import Retired
from gpusnap.storage.unreadable import UnreadableManifest

__all__ = ["GcReport", "Retention", "merge_reports"]


@dataclass(frozen=True)
class GcReport:
    """What a gc run removed, or why it held back.

    ``freed_bytes`` counts everything it freed: manifests, dead packs, the packs it compacted
    less the packs that replaced them (``compacted_bytes``), and ``tmp/`` files. Compaction
    (``storage.compact``): ``compacted_packs`` were rewritten into ``written_packs``, which
    took ``rewritten_bytes`` of live chunks. ``dead_bytes``: chunk bytes no checkpoint names
    still kept in partly live packs. ``problems``: corrupt chunks compaction found (their
    packs are kept whole), in verify's words."""

    deleted_checkpoints: tuple[str, ...] = ()
    deleted_packs: tuple[str, ...] = ()
    freed_bytes: int = 0
    skipped: bool = False
    notes: tuple[str, ...] = ()
    unreadable: tuple[UnreadableManifest, ...] = ()  # why no pack was deleted, when not empty
    compacted_packs: tuple[str, ...] = ()
    written_packs: tuple[str, ...] = ()
    rewritten_bytes: int = 0
    compacted_bytes: int = 0
    dead_bytes: int = 0
    problems: tuple[str, ...] = ()


class Retention:
    """gc of one root (see :meth:`gc`)."""

    backend: Backend
    config: Config
    root: str
    _mutex: threading.RLock
    _refresh_mutex: threading.RLock
    _packs: dict[str, PackIndex]
    _manifest_cache: dict[str, Manifest]
    _retired: Retired
    _opening: int
    _pins: dict[Any, set[str]]  # open write transaction -> the digests gc must keep

    def gc(
        self, keep_last: int | None = None, *, blocking: bool = True, timeout: float = 30.0, fresh: bool = True,
        compact: bool = True, progress: Callable[[int], Callable[[int], None]] | None = None,
    ) -> GcReport:
        """Delete old checkpoints, then packs nothing references, then compact packs that are
        mostly dead, then delete stale ``tmp/`` files.

        Holds the writer lease (a gc from another process waits, up to ``timeout``, for the
        writer to close; with ``blocking=False`` it is skipped), then the exclusive root lock
        (it waits for readers such as verify), except while write transactions of this
        object are open: it does not wait for them but keeps what they rely on (pins, their
        ``tmp/`` files). So a Checkpointer's retention runs after every commit even while the
        next save writes. Crash-safe in every order: manifests go first, so an interrupted
        gc leaves only garbage.

        A pack is deleted when *none* of its chunks is referenced or pinned. With ``compact``,
        a pack of whose chunk bytes more than ``Config.gc_compact_percent`` per cent are dead
        has its live chunks rewritten into a new pack, which is made durable before the old
        one is deleted (``storage.compact``: manifests name chunks by digest, so none is
        touched; a crash at any step leaves only garbage). Compaction needs the root to
        itself: it is skipped (a note says so) while transactions of this object are open,
        and a Checkpointer's retention passes ``compact=False``, so that rewriting packs never
        competes with the next save's writes. If any manifest is unreadable, no pack is
        deleted or compacted at all: its references are unknown (``GcReport.unreadable``).

        ``fresh=False`` takes the manifests this object has already read or committed from
        its cache (the list of manifest files is always read afresh): a Checkpointer's
        retention after each commit. Committed manifests never change, and a cached one
        still names every chunk it needs, so no pack it needs can be deleted. Re-reading
        them cost every save a parse of each retained manifest on the writer thread, and
        replaced the committed manifest (whose tree shares its nodes with the next save's)
        by a parsed copy: ~10k more objects per retained checkpoint of GPT-2 large for
        Python's full collections to walk.

        ``progress``, for a progress bar over compaction (what takes time): called once, when
        compaction has chosen its packs, with the bytes of their live chunks (what it
        rewrites, less a chunk that a kept pack holds a good copy of, or a corrupt one); it
        returns a callable that is then called with each chunk's length as it goes, the
        lengths summing to that total. Not called when nothing is compacted.
        """
        if keep_last is not None and keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 or None, got {keep_last}")
        wait = timeout if blocking else 0.0
        try:
            self._hold_lease(wait)
        except StorageError as exc:
            if blocking:
                raise
            return GcReport(skipped=True, notes=(str(exc),))
        lock: BackendLock | None = None
        pins_only = False
        try:
            try:
                lock = self._gc_lock(wait)
                pins_only = lock is None
            except StorageError as exc:
                if blocking:
                    raise
                return GcReport(skipped=True, notes=(str(exc),))
            self.confirm_lease("gc: confirming the writer lease")
            return self._gc_locked(keep_last, fresh, compact=compact, alone=lock is not None, progress=progress)
        finally:
            if lock is not None:
                lock.release()
            if pins_only:
                self.leave_pins_only_gc()
            self._lease.drop()

    def _has_txns(self) -> bool:
        """Whether a write transaction of this object is open or opening (its shared lock,
        held or wanted, keeps gc from the exclusive one: gc then relies on the pins)."""
        with self._mutex:
            return bool(self._pins) or self._opening > 0

    def _gc_lock(self, timeout: float) -> BackendLock | None:
        """The exclusive root lock, or None while this object's own transactions are open
        (their shared locks exclude it; pins protect them instead)."""
        got: builtins.list[BackendLock] = []

        def attempt() -> bool:
            # on the pins alone only while no transaction runs elsewhere, and none starts
            # before this gc ends (writing_elsewhere waits): the pins do not name its chunks
            if self._has_txns() and self.enter_pins_only_gc():
                return True
            try:
                got.append(self.backend.lock(exclusive=True, timeout=0.0))
                return True
            except TimeoutError:
                return self._has_txns() and self.enter_pins_only_gc()  # one began meanwhile
            except OSError as exc:
                raise storage_error(exc, "locking", self.backend.describe("lock"), writing=False) from exc

        if not poll_until(attempt, timeout):
            raise StorageError(
                f"another process holds {self.root} (gc or save in progress, or a verify; or this program's "
                f"promotion helper writing); "
                f"gave up waiting for the exclusive lock after {timeout:g}s"
            )
        return got[0] if got else None

    def _gc_locked(self, keep_last: int | None, fresh: bool = True, *, compact: bool = False,
                   alone: bool = False, progress: Callable[[int], Callable[[int], None]] | None = None) -> GcReport:
        """gc with the lease held (and the exclusive root lock when ``alone``)."""
        notes: builtins.list[str] = []
        freed = 0
        compaction = Compaction()
        partly: builtins.list[PackIndex] = []
        dead_bytes = 0
        manifests, bad = self._scan(fresh=fresh)
        deleted_ids: builtins.list[str] = []
        if keep_last is not None and len(manifests) > keep_last:
            doomed = manifests[: len(manifests) - keep_last]
            for m in doomed:
                path = f"{MANIFESTS}/{m.id}.json"
                with self.io_errors("gc: deleting manifest", path):
                    try:
                        freed += self.backend.size(path)
                    except FileNotFoundError:
                        pass
                    self.backend.remove(path)
                deleted_ids.append(m.id)
                self._retired.note(m, keep_last)
            if self.config.fsync:
                with self.io_errors("gc: syncing", MANIFESTS):
                    self.backend.sync_dir(MANIFESTS)
            with self._mutex:
                for cid in deleted_ids:
                    self._manifest_cache.pop(f"{cid}.json", None)

        deleted_packs: builtins.list[str] = []
        if bad:
            notes.append(
                f"deleted no packs: {len(bad)} manifest(s) are unreadable, so which packs they need "
                f"is unknown ({bad[0].path}: {bad[0].reason}); fix or delete them, then run gc again"
            )
        else:
            with self._refresh_mutex:  # no refresh brings a doomed pack back before it is gone
                errors: builtins.list[tuple[str, str]] = []
                self._refresh_packs(errors)
                for path, err in errors:
                    notes.append(f"kept pack with unreadable index {self.backend.describe(path)}: {err}")
                retained = [m for m in manifests if m.id not in deleted_ids]
                doomed_packs, live = self._doom_packs(retained, set(deleted_ids))
                for index in doomed_packs:
                    with self.io_errors("gc: deleting pack", index.path):
                        self.backend.remove(index.path)
                    deleted_packs.append(index.path)
                    freed += index.size
                if compact and alone:
                    compaction = self._compact(live, progress)
                    freed += compaction.freed_bytes
                with self._mutex:
                    partly = [i for i in self._collectable() if 0 < pack_dead_bytes(i, live)]
                dead_bytes = sum(pack_dead_bytes(i, live) for i in partly)
            if partly:
                why = (f"each at most {self.config.gc_compact_percent}% dead: Config.gc_compact_percent"
                       + ("; a pack with a corrupt chunk is kept whole" if compaction.problems else "")
                       if compact and alone else
                       "compaction needs the root to itself: this object's saves are writing" if compact else
                       f"compaction off: `gpusnap gc {self.root}` compacts")
                notes.append(f"{len(partly)} pack(s) are partly live: {dead_bytes} dead bytes kept ({why})")

        names = self.listdir(TMP)
        with self._mutex:
            live_tmp = tuple(f"{txn.token}-" for txn in self._pins)
        for name in names:
            if name.startswith(live_tmp):
                continue  # an open transaction of this object writes it
            path = f"{TMP}/{name}"
            try:
                size = self.backend.size(path)
                self.backend.remove(path)
                freed += size
            except FileNotFoundError:
                pass
            except OSError as exc:
                notes.append(f"could not delete temporary {self.backend.describe(path)}: {os_reason(exc)}")
        return GcReport(tuple(deleted_ids), tuple(deleted_packs), freed, False, tuple(notes), tuple(bad),
                        compacted_packs=compaction.compacted, written_packs=compaction.written,
                        rewritten_bytes=compaction.rewritten_bytes, compacted_bytes=compaction.freed_bytes,
                        dead_bytes=dead_bytes, problems=compaction.problems)

    def _compact(self, live: set[str], progress: Callable[[int], Callable[[int], None]] | None = None) -> Compaction:
        """Compact this root's mostly dead packs (``storage.compact``), the root held alone."""
        with self._mutex:
            packs = self._collectable()
        chosen = mostly_dead(packs, live, self.config.gc_compact_percent)
        paths = {i.path for i in chosen}
        return compact_packs(self, chosen, [i for i in packs if i.path not in paths], live, progress)

    def _doom_packs(
        self, retained: builtins.list[Manifest], deleted: set[str]
    ) -> tuple[builtins.list[PackIndex], set[str]]:
        """Packs no manifest needs and no open transaction pinned, forgotten at once (so no
        transaction reuses their chunks from now on), and the live digests.

        Live: every manifest listed or committed (``retained``, and the cache less what this
        gc deleted: a commit that finished after the listing is in it) and every pin, in one
        step under the mutex that pinning takes."""
        with self._mutex:
            live = {d for pins in self._pins.values() for d in pins}
            live.update(d for m in retained for st in m.storages for d in st.chunks)
            for m in self._manifest_cache.values():
                if m.id not in deleted:
                    live.update(d for st in m.storages for d in st.chunks)
            doomed = [i for i in self._collectable() if not any(e[0] in live for e in i.entries)]
            for index in doomed:
                del self._packs[index.path]
            if doomed:
                self._rebuild_chunk_map()
        return doomed, live

    def _collectable(self) -> builtins.list[PackIndex]:
        """The packs this root's gc may delete: all it knows (a distributed root's rank packs
        are each rank's own: storage/ranks.py)."""
        return builtins.list(self._packs.values())


def merge_reports(reports: Sequence[GcReport]) -> GcReport:
    """One report of several gc runs (a distributed root's ranks): tuples joined, counts added."""
    tuples = ("deleted_checkpoints", "deleted_packs", "notes", "unreadable", "compacted_packs", "written_packs",
              "problems")
    counts = ("freed_bytes", "rewritten_bytes", "compacted_bytes", "dead_bytes")
    fields: dict[str, Any] = {k: tuple(x for r in reports for x in getattr(r, k)) for k in tuples}
    fields.update({k: sum(getattr(r, k) for r in reports) for k in counts})
    return GcReport(skipped=any(r.skipped for r in reports), **fields)
