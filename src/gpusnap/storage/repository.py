"""The checkpoint repository: packs + manifests under one root, with atomic commits and gc.

Visibility rule (docs/architecture.md): a checkpoint exists once ``manifests/<id>.json`` exists
with a valid checksum; every pack it names was fsynced and renamed into ``packs/`` before the
manifest was renamed into place. Everything else (``tmp/``, packs no manifest references) is
garbage that only ``gc`` removes.

One writer per root (``storage.lease``): write transactions and gc hold the root's writer
lease, a Checkpointer from its first save to ``close()``. gc then deletes nothing a write
transaction of the same Repository relies on: every chunk it stored or reused is *pinned*
until it commits or aborts, and its ``tmp/`` files are kept. The root lock (shared for write
transactions and verify, exclusive for gc) still keeps a gc away from readers and from
writers that predate the lease, except that a gc does not wait for its own transactions.

Parts: reading chunks in ``storage.chunk_reads``, gc in ``storage.retention``, write
transactions in ``storage.txn`` (they use the small public interface under "for write
transactions" below: pins, the commit lock, the lease check, I/O errors), verification in
``storage.verify``, the root's layout and error helpers in ``storage.layout``. A subclass
for another kind of root (``storage.fast_tier``, ``storage.ranks``) names its kind
(``root_kind``) and :meth:`Repository.open` returns it for such roots.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

from gpusnap.config import Config
from gpusnap.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    IntegrityError,
    StorageError,
)
from gpusnap.storage.backend import Backend, BackendLock, open_backend
from gpusnap.storage.chunk_reads import ChunkReads, PackReads
from gpusnap.storage.layout import (
    ID_RE,
    LAYOUT,
    MANIFESTS,
    PACKS,
    RANKS,
    ROOT_FILE,
    TMP,
    storage_error,
)
from gpusnap.storage.lease import LEASE_NAME, LeaseBusy, LeaseHolds
from gpusnap.storage.manifest import FORMAT, VERSION, Manifest, RankPart, canonical_json
from gpusnap.storage.pack import PackIndex
from gpusnap.storage.retention import GcReport, Retention, merge_reports
from gpusnap.storage.txn import WriteTxn
from gpusnap.storage.unknown_ref import Retired, unknown_ref
from gpusnap.storage.unreadable import UnreadableManifest, id_time, may_be_newer
from gpusnap.storage.verify import VerifyReport, verify

__all__ = ["ChunkReads", "GcReport", "Repository", "UnreadableManifest", "VerifyReport", "WriteTxn", "fresh_id", "merge_reports"]

log = logging.getLogger("gpusnap")


class Repository(PackReads, Retention):
    """A checkpoint root. Thread-safe; open one per process (or several: locks and the writer
    lease are per object, so two objects on one root cannot both write)."""

    _kinds: ClassVar[dict[str, type[Repository]]] = {}  # root kind -> the class that opens it
    holds_ranks = False  # a root of distributed checkpoints (storage.ranks)

    def __init_subclass__(cls, root_kind: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if root_kind is not None:
            Repository._kinds[root_kind] = cls

    def __init__(self, backend: Backend, config: Config) -> None:
        """Use :meth:`open`; this constructor assumes the root layout already exists."""
        self.backend = backend
        self.config = config
        self.root: str = backend.root
        self._mutex = threading.RLock()
        self._refresh_mutex = threading.RLock()  # also held by gc: no pack it dooms comes back
        self._packs: dict[str, PackIndex] = {}
        self._chunks: dict[str, tuple[str, int, int]] = {}
        self._manifest_cache: dict[str, Manifest] = {}
        self._issued_ids: set[str] = set()
        self._lease = LeaseHolds(backend.writer_lease)
        # open write transactions -> the digests gc must keep for each (stored or reused), under _mutex
        self._pins: dict[Any, set[str]] = {}
        # begin_write calls between taking the shared lock and registering their transaction:
        # gc must count them as open (their shared lock excludes its exclusive one)
        self._opening = 0
        # write transactions a helper process runs for this writer (a promotion:
        # storage/promote_process.py) and gcs relying on this object's pins alone: the two
        # exclude each other (the pins do not name what the helper reuses or its tmp/ files)
        self._elsewhere = 0
        self._pins_only_gcs = 0
        self._elsewhere_turn = threading.Condition(self._mutex)
        self._cache_complete = False  # _manifest_cache lists every readable manifest (writer only)
        self.commit_lock = threading.Lock()  # commits of this object, one at a time (txn.py, fast_txn.py)
        self._warned: set[str] = set()  # unreadable manifests already reported (warn_unreadable)
        self._retired = Retired()  # what this object's retention deleted, for lookup errors

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str],
        *,
        create: bool = False,
        storage_options: dict[str, Any] | None = None,
        config: Config | None = None,
        backend: Backend | None = None,
        root_doc: dict[str, Any] | None = None,
    ) -> Repository:
        """Open (or with ``create=True`` initialise) the checkpoint root at ``root``.

        A fast tier's root (``storage/fast_tier.py``) opens as a :class:`FastTier`; a root
        created here is durable unless ``root_doc`` (extra root-file fields) says otherwise.
        """
        backend = backend if backend is not None else open_backend(root, storage_options)
        config = config if config is not None else Config.from_env()
        where = backend.root
        try:
            if not backend.exists(""):
                if not create:
                    raise CheckpointNotFoundError(f"no checkpoint root at {where} (nothing has been saved there yet: a Checkpointer creates it at its first save; check the path)")
                cls._initialise(backend, doc=root_doc)
            elif not backend.isdir(""):
                raise CheckpointError(f"{where} is a file, not a checkpoint root directory")
            elif ROOT_FILE in (names := set(backend.listdir(""))):
                tier = cls._check_root_file(backend).get("tier", "durable")
                if create:
                    if tier != (root_doc or {}).get("tier", "durable"):
                        raise CheckpointError(
                            f"{where} is a {tier} tier's root: a Checkpointer's root and fast_root need "
                            "directories of their own"
                        )
                    cls._initialise(backend, root_file=False)
            elif names <= LAYOUT:
                # Empty, or a root another process is creating right now (gpusnap.json comes
                # last): either way creating it here is safe and idempotent.
                if not create:
                    raise CheckpointNotFoundError(f"no checkpoint root at {where} (the directory is empty)")
                cls._initialise(backend, doc=root_doc)
            else:
                raise CheckpointError(
                    f"{where} exists but is not a gpusnap checkpoint root (no {ROOT_FILE}); "
                    "pick an empty or new directory"
                )
        except OSError as exc:
            raise storage_error(exc, "opening checkpoint root", where, writing=False) from exc
        if cls is Repository:  # (the subclasses register themselves: gpusnap.storage imports them)
            if backend.exists(ROOT_FILE) and cls._check_root_file(backend).get("tier") == "fast":
                return cls._kinds["fast"](backend, config)
            if backend.exists(RANKS):  # it holds distributed checkpoints
                return cls._kinds["ranks"](backend, config)
        return cls(backend, config)

    @staticmethod
    def _initialise(backend: Backend, *, root_file: bool = True, doc: dict[str, Any] | None = None) -> None:
        for d in (PACKS, MANIFESTS, TMP):
            backend.makedirs(d)
        if root_file:
            tmp = f"{TMP}/{ROOT_FILE}.{os.getpid()}-{secrets.token_hex(4)}"
            handle = backend.open_write(tmp)
            try:
                handle.write(canonical_json({"format": FORMAT, "version": VERSION, **(doc or {})}))
            finally:
                handle.close(sync=True)
            backend.rename(tmp, ROOT_FILE)
            backend.sync_dir("")
        # Creates ROOT/lock now, so that a root later mounted read-only can still be locked.
        try:
            backend.lock(exclusive=False, timeout=0.0).release()
        except TimeoutError:
            pass  # someone holds it, so it exists
        if root_file and not backend.exists(LEASE_NAME):  # (empty: no writer)
            backend.open_write(LEASE_NAME).close(sync=False)

    @staticmethod
    def _check_root_file(backend: Backend) -> dict[str, Any]:
        where = backend.describe(ROOT_FILE)
        try:
            doc = json.loads(backend.read_range(ROOT_FILE).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise CheckpointError(f"{where} is not valid JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise CheckpointError(
                f"{where} describes an unsupported layout {doc!r}; this gpusnap reads version {VERSION}"
            )
        return doc

    def __repr__(self) -> str:
        return f"Repository({self.root!r})"

    # ------------------------------------------------------------------ helpers

    @contextmanager
    def io_errors(self, doing: str, path: str, *, writing: bool = False) -> Iterator[None]:
        """Turn an :class:`OSError` raised inside into a :class:`StorageError` that says what
        was being done (``doing``) to which file (``path``)."""
        try:
            yield
        except OSError as exc:
            raise storage_error(exc, doing, self.backend.describe(path), writing=writing) from exc

    def lock_root(self, *, exclusive: bool, timeout: float) -> BackendLock:
        """The root lock (shared: write transactions, verify; exclusive: gc), waiting up to
        ``timeout``; a :class:`StorageError` when it stays busy."""
        try:
            return self.backend.lock(exclusive=exclusive, timeout=timeout)
        except TimeoutError:
            raise StorageError(
                f"another process holds {self.root} (gc or save in progress); "
                f"gave up waiting for the {'exclusive' if exclusive else 'shared'} lock after {timeout:g}s"
            ) from None
        except OSError as exc:
            raise storage_error(exc, "locking", self.backend.describe("lock"), writing=False) from exc

    # ------------------------------------------------------------------ the writer lease

    def _hold_lease(self, timeout: float) -> None:
        """Add a hold on the writer lease (see ``storage.lease``), or raise a StorageError
        naming the writer that has it."""
        try:
            self._lease.hold(timeout)
        except LeaseBusy as exc:
            waited = f"; gave up waiting after {timeout:g}s" if timeout > 0 else ""
            raise StorageError(
                f"another writer holds {self.root} (gc or save in progress): {exc.holder}. A root takes "
                "one writer at a time (restore, ls, show and verify work meanwhile): close that "
                f"Checkpointer, or let its process or gc finish, then write again{waited}"
            ) from None
        except OSError as exc:
            raise storage_error(exc, "taking the writer lease", self.backend.describe(LEASE_NAME), writing=False) from exc

    def renew_lease(self) -> None:
        """Check (and renew) the writer lease this object holds; :class:`OSError` if it was
        lost (an object store's, taken over after it went stale)."""
        self._lease.confirm()

    def confirm_lease(self, doing: str) -> None:
        """:meth:`renew_lease`, its failure a :class:`StorageError` naming ``doing``."""
        try:
            self.renew_lease()
        except OSError as exc:
            raise storage_error(exc, doing, self.backend.describe(LEASE_NAME), writing=True) from exc

    def claim_writer(self) -> None:
        """Become this root's writer until :meth:`release_writer` (a Checkpointer: from its first
        save to ``close()``). Idempotent. Raises :class:`StorageError` naming the other writer
        (its pid and host where known) when one holds the root; readers are not affected."""
        with self._mutex:
            if self._lease.persistent:
                return
            self._hold_lease(0.0)
            self._lease.persistent = True
            self._cache_complete = False  # scanned afresh as the writer (tag_owner)

    def release_writer(self) -> None:
        """Stop being the writer (the lease goes once no transaction or gc of this object runs)."""
        with self._mutex:
            if not self._lease.persistent:
                return
            self._lease.persistent = False
            self._cache_complete = False
        self._lease.drop()

    @property
    def is_writer(self) -> bool:
        """Whether this object holds the root's writer lease now."""
        return self._lease.held

    def close(self) -> None:
        """Release what this object holds on the root (the writer lease); reading still works."""
        self.release_writer()

    # ------------------------------------------------------------------ ids and manifests

    def new_id(self, created: float) -> str:
        """``YYYYMMDD-HHMMSS-mmm-xxxxxx`` (UTC, milliseconds, random hex): sortable and unique.

        No I/O (save() calls it while the caller waits): 24 random bits make ids from
        concurrent processes distinct within a millisecond, ids issued by this object are
        never repeated, and commit refuses to overwrite an existing manifest.
        """
        with self._mutex:
            while True:
                cid = fresh_id(created)
                if cid not in self._issued_ids:
                    self._issued_ids.add(cid)
                    return cid

    def _read_manifest(self, name: str) -> Manifest:
        path = f"{MANIFESTS}/{name}"
        where = self.backend.describe(path)
        try:
            data = self.backend.read_range(path)
        except FileNotFoundError:
            raise  # callers decide: vanished during a listing, or an unknown id
        except OSError as exc:
            raise storage_error(exc, "reading manifest", where, writing=False) from exc
        manifest = Manifest.from_json(data, where)
        if f"{manifest.id}.json" != name:
            raise IntegrityError(f"manifest {where} holds id {manifest.id!r}, which does not match its file name")
        return manifest

    def _scan(self, *, fresh: bool = False) -> tuple[builtins.list[Manifest], builtins.list[UnreadableManifest]]:
        """All manifests, split into readable (oldest first) and unreadable (by name).

        Committed manifests never change, so readable ones are cached by file name; ``fresh``
        re-reads every file (verify).
        """
        good: builtins.list[Manifest] = []
        bad: builtins.list[UnreadableManifest] = []
        complete = self._lease.persistent  # a writer's scan: nobody else adds manifests
        with self._mutex:
            known = set(self._manifest_cache)  # a commit cached after the listing stays cached
        names = [n for n in self.listdir(MANIFESTS) if n.endswith(".json")]
        for name in names:
            cached = None if fresh else self._manifest_cache.get(name)
            if cached is not None:
                good.append(cached)
                continue
            try:
                manifest = self._read_manifest(name)
            except FileNotFoundError:
                continue
            except CheckpointError as exc:  # IntegrityError, unknown version, StorageError
                cid = name[: -len(".json")]
                where = self.backend.describe(f"{MANIFESTS}/{name}")
                bad.append(UnreadableManifest(cid, where, " ".join(str(exc).split()), id_time(cid)))
                continue
            with self._mutex:
                self._manifest_cache[name] = manifest
            good.append(manifest)
        with self._mutex:
            for stale in known - set(names):
                self._manifest_cache.pop(stale, None)
            if complete and self._lease.persistent:
                self._cache_complete = True
        good.sort(key=lambda m: (m.created, m.id))
        return good, bad

    def list(self) -> builtins.list[Manifest]:
        """Committed, readable checkpoints, oldest first (by ``created``, then id)."""
        return self._scan()[0]

    def scan(self, *, fresh: bool = False) -> tuple[builtins.list[Manifest], builtins.list[UnreadableManifest]]:
        """:meth:`list` and :meth:`unreadable` from one listing of ``manifests/`` (``fresh``:
        every manifest read again, none taken from this object's cache)."""
        return self._scan(fresh=fresh)

    def problems(self) -> builtins.list[tuple[str, str]]:
        """``(manifest file, error)`` for every manifest that cannot be read or fails its checksum."""
        return [(u.path, u.reason) for u in self._scan()[1]]

    def unreadable(self) -> builtins.list[UnreadableManifest]:
        """Every manifest that exists but cannot be read, parsed or checked, by id: the
        checkpoints ``list()`` leaves out (``gpusnap ls`` marks them)."""
        return self._scan()[1]

    def skipped_newer(self, chosen: Manifest, ref: str | None = None) -> builtins.list[UnreadableManifest]:
        """Unreadable manifests that :meth:`resolve` passed over to pick ``chosen`` for ``ref``:
        those that may be newer (``unreadable.may_be_newer``). None for an exact id. (A fresh
        listing: :meth:`resolve_reporting` answers from the listing the choice was made on.)"""
        return _passed_over(chosen, ref, self._scan()[1])

    def warn_unreadable(self, entries: Sequence[UnreadableManifest], consequence: str) -> None:
        """A WARNING on the ``gpusnap`` logger for each of ``entries`` not yet reported by this
        object (a Checkpointer warns once per file, not at every save or list)."""
        for u in entries:
            with self._mutex:
                if u.path in self._warned:
                    continue
                self._warned.add(u.path)
            log.warning(
                "gpusnap: checkpoint %s is unreadable (%s): %s; %s. Run `gpusnap verify %s`, then "
                "repair or delete that file", u.id, u.path, u.reason, consequence, self.root,
            )

    def refuse_taken_tag(self, manifest: Manifest) -> None:
        """At a commit, under ``commit_lock``: a CheckpointError when ``manifest``'s tag already
        names another committed checkpoint (a tag names one checkpoint)."""
        if manifest.tag is None:
            return
        owner = self.tag_owner(manifest.tag, other_than=manifest.id)
        if owner is not None:
            raise CheckpointError(
                f"tag {manifest.tag!r} already names checkpoint {owner} in {self.root}; a tag names "
                f"one checkpoint: {manifest.id} was not committed"
            )

    def tag_owner(self, tag: str, *, other_than: str | None = None) -> str | None:
        """The id of the committed checkpoint tagged ``tag`` (other than ``other_than``), or None.

        The writer answers from the manifests it has seen since it claimed the root (nobody
        else adds any meanwhile): no I/O, so ``save()`` can check a tag without a listing."""
        with self._mutex:
            cached = builtins.list(self._manifest_cache.values()) if self._cache_complete else None
        manifests = cached if cached is not None else self._scan()[0]
        for m in manifests:
            if m.tag == tag and m.id != other_than:
                if cached is not None and not self._still_there(m.id):
                    continue  # deleted by hand since: its tag is free again
                return m.id
        return None

    def _still_there(self, checkpoint_id: str) -> bool:
        name = f"{checkpoint_id}.json"
        try:
            if self.backend.exists(f"{MANIFESTS}/{name}"):
                return True
        except OSError:
            return True  # cannot tell: keep refusing the tag
        with self._mutex:
            self._manifest_cache.pop(name, None)
        return False

    def load_manifest(self, checkpoint_id: str) -> Manifest:
        """Read one manifest by id, checksum verified (no cache)."""
        if not ID_RE.match(checkpoint_id):
            raise CheckpointNotFoundError(f"no checkpoint {checkpoint_id!r} in {self.root}")
        try:
            return self._read_manifest(f"{checkpoint_id}.json")
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no checkpoint {checkpoint_id!r} in {self.root}") from None

    def resolve(self, ref: str | None) -> Manifest:
        """``None``: the newest readable checkpoint; else an id; else the newest with that tag."""
        return self.resolve_reporting(ref)[0]

    def resolve_reporting(self, ref: str | None) -> tuple[Manifest, builtins.list[UnreadableManifest]]:
        """:meth:`resolve`, and the unreadable manifests it passed over that may be newer than
        its choice, from the one listing the choice was made on (a manifest unreadable for a
        moment must not be skipped without a word: a second listing might read it)."""
        manifests, bad = self._scan()
        chosen = self._choose(ref, manifests, bad)
        return chosen, _passed_over(chosen, ref, bad)

    def _choose(
        self, ref: str | None, manifests: builtins.list[Manifest], bad: builtins.list[UnreadableManifest]
    ) -> Manifest:
        note = f" ({len(bad)} unreadable manifest(s), e.g. {bad[-1].path}: {bad[-1].reason}; run verify)" if bad else ""
        if ref is not None and any(u.id == ref for u in bad):
            return self.load_manifest(ref)  # raises why it is unreadable (unless repaired meanwhile)
        if ref is None:
            if not manifests:
                raise CheckpointNotFoundError(f"no committed checkpoint in {self.root}{note}")
            return manifests[-1]
        for m in manifests:
            if m.id == ref:
                return m
        tagged = [m for m in manifests if m.tag == ref]
        if tagged:
            return tagged[-1]
        raise unknown_ref(ref, self.root, manifests, self._retired, note)

    def rank_manifest(self, manifest: Manifest, part: RankPart) -> Manifest:
        """Rank ``part.rank``'s manifest of the distributed ``manifest``: a root of
        distributed checkpoints reads it (``storage.ranks``); this one has none."""
        raise CheckpointError(f"checkpoint {manifest.id}: distributed, but {self.root} has no ranks/ directory")

    def delete(self, checkpoint_id: str, *, timeout: float = 30.0) -> None:
        """Remove one manifest (the checkpoint disappears); its packs wait for :meth:`gc`.
        A write: it holds the writer lease (waiting up to ``timeout`` for another writer)."""
        if not ID_RE.match(checkpoint_id):
            raise CheckpointNotFoundError(f"no checkpoint {checkpoint_id!r} in {self.root}")
        path = f"{MANIFESTS}/{checkpoint_id}.json"
        self._hold_lease(timeout)
        try:
            with self.io_errors("deleting checkpoint", path):
                if not self.backend.exists(path):
                    raise CheckpointNotFoundError(f"no checkpoint {checkpoint_id!r} in {self.root}")
                self.backend.remove(path)
                if self.config.fsync:
                    self.backend.sync_dir(MANIFESTS)
            with self._mutex:
                self._manifest_cache.pop(f"{checkpoint_id}.json", None)
        finally:
            self._lease.drop()

    # ------------------------------------------------------------------ writing

    def begin_write(self, *, timeout: float = 60.0) -> WriteTxn:
        """Start a write transaction: the writer lease, the shared root lock, then a fresh view
        of existing packs. Waits up to ``timeout`` for each; a :class:`StorageError` names the
        writer or gc that holds the root."""
        self._hold_lease(timeout)
        with self._mutex:
            self._opening += 1
        try:
            try:
                lock = self.lock_root(exclusive=False, timeout=timeout)
            except BaseException:
                self._lease.drop()
                raise
            try:
                return self._new_txn(lock)
            except BaseException:
                lock.release()
                self._lease.drop()
                raise
        finally:
            with self._mutex:
                self._opening -= 1

    def _new_txn(self, lock: BackendLock) -> WriteTxn:
        """The transaction, once the lease and the shared lock are held (a fast tier makes its own)."""
        self._refresh_packs()
        return WriteTxn(self, lock)

    # ------------------------------------------------------------------ for write transactions

    def txn_opened(self, txn: Any) -> None:
        """Register ``txn`` (its ``token`` names its ``tmp/`` files): gc keeps its pins and
        files from now until :meth:`txn_closed`."""
        with self._mutex:
            self._pins[txn] = set()

    def txn_closed(self, txn: Any) -> bool:
        """``txn`` committed or aborted: unpin its chunks (after a commit its manifest is
        cached, so gc sees them). Whether it was open (its lease hold then goes with
        :meth:`drop_lease_hold`, once it has released its lock)."""
        with self._mutex:
            return self._pins.pop(txn, None) is not None

    def drop_lease_hold(self) -> None:
        """Let go of one hold on the writer lease (a transaction's, taken by :meth:`begin_write`)."""
        self._lease.drop()

    def pin_if_stored(self, txn: Any, digest: str) -> bool:
        """Whether ``digest`` is stored; if so, pinned for ``txn`` (gc keeps its pack), in one
        step with gc's choice of packs to delete."""
        with self._mutex:
            if digest in self._chunks:
                pins = self._pins.get(txn)  # (none once txn has ended: nothing left to keep)
                if pins is not None:
                    pins.add(digest)
                return True
            return False

    def pin(self, txn: Any, digest: str) -> None:
        """Keep ``digest`` through gc until ``txn`` ends (a chunk in its temporary pack)."""
        with self._mutex:
            pins = self._pins.get(txn)  # (none once txn has ended: nothing left to keep)
            if pins is not None:
                pins.add(digest)

    @contextmanager
    def writing_elsewhere(self) -> Iterator[None]:
        """A write transaction of this writer runs in another process meanwhile (under this
        object's lease and its own shared root lock). This object's pins do not name its
        chunks or its ``tmp/`` files, so no gc may rely on them alone meanwhile: one that does
        is waited for first, and a later gc waits for the exclusive lock (for it to end)."""
        with self._elsewhere_turn:
            while self._pins_only_gcs:
                self._elsewhere_turn.wait()
            self._elsewhere += 1
        try:
            yield
        finally:
            with self._elsewhere_turn:
                self._elsewhere -= 1

    def enter_pins_only_gc(self) -> bool:
        """A gc may rely on this object's pins (its own transactions hold the root's shared
        lock): True, until :meth:`leave_pins_only_gc`, unless a transaction runs elsewhere."""
        with self._elsewhere_turn:
            if self._elsewhere:
                return False
            self._pins_only_gcs += 1
            return True

    def leave_pins_only_gc(self) -> None:
        with self._elsewhere_turn:
            self._pins_only_gcs -= 1
            self._elsewhere_turn.notify_all()

    def remember_committed(self, manifest: Manifest) -> None:
        """A manifest ``txn`` just committed: listed and resolved from now on without a read."""
        with self._mutex:
            self._manifest_cache[f"{manifest.id}.json"] = manifest

    # ------------------------------------------------------------------ verify

    def verify(
        self, checkpoint_id: str | None = None, *, progress: Callable[[int], None] | None = None,
        on_total: Callable[[int], None] | None = None,
    ) -> VerifyReport:
        """Re-hash every chunk of one checkpoint (id or tag) or of all (``storage.verify``)."""
        return verify(self, checkpoint_id, progress=progress, on_total=on_total)


def fresh_id(created: float) -> str:
    """A new id ``YYYYMMDD-HHMMSS-mmm-xxxxxx`` for time ``created`` (see :meth:`Repository.new_id`)."""
    seconds, millis = divmod(round(created * 1000), 1000)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(seconds))
    return f"{stamp}-{millis:03d}-{secrets.token_hex(3)}"


def _passed_over(
    chosen: Manifest, ref: str | None, bad: Sequence[UnreadableManifest]
) -> builtins.list[UnreadableManifest]:
    if ref is not None and ref == chosen.id:
        return []
    return [u for u in bad if u.id != chosen.id and may_be_newer(u, chosen.id)]

