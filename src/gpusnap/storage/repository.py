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

Write transactions are in ``storage.txn``, verification in ``storage.verify``, the root's
layout and error helpers in ``storage.layout``.
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
from dataclasses import dataclass
from typing import Any

from gpusnap.config import Config
from gpusnap.errors import CheckpointError, CheckpointNotFoundError, IntegrityError, StorageError
from gpusnap.kernels.hashing import chunk_digest
from gpusnap.storage.backend import Backend, BackendLock, _poll_until, open_backend
from gpusnap.storage.compact import Compaction, mostly_dead
from gpusnap.storage.compact import compact as compact_packs
from gpusnap.storage.compact import dead_bytes as pack_dead_bytes
from gpusnap.storage.lease import LEASE_NAME, LeaseBusy, LeaseHolds
from gpusnap.storage.layout import (
    ID_RE,
    LAYOUT,
    MANIFESTS,
    PACKS,
    RANKS,
    ROOT_FILE,
    TMP,
    about,
    byte_view,
    map_chunks,
    os_reason,
    storage_error,
)
from gpusnap.storage.manifest import FORMAT, VERSION, Manifest, canonical_json
from gpusnap.storage.pack import PackIndex, read_pack_index
from gpusnap.storage.txn import WriteTxn
from gpusnap.storage.unknown_ref import Retired, unknown_ref
from gpusnap.storage.unreadable import UnreadableManifest, id_time, may_be_newer
from gpusnap.storage.verify import VerifyReport, verify

__all__ = ["ChunkReads", "GcReport", "Repository", "UnreadableManifest", "VerifyReport", "WriteTxn", "merge_reports"]

log = logging.getLogger("gpusnap")


@dataclass(frozen=True)
class ChunkReads:
    """What one :meth:`Repository.read_chunks_into` cost: system reads, seconds reading and verifying."""

    reads: int
    read_s: float
    verify_s: float


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


class Repository:
    """A checkpoint root. Thread-safe; open one per process (or several: locks and the writer
    lease are per object, so two objects on one root cannot both write)."""

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
        self._txns: set[WriteTxn] = set()  # open write transactions (their pins), under _mutex
        # begin_write calls between taking the shared lock and registering their transaction:
        # gc must count them as open (their shared lock excludes its exclusive one)
        self._opening = 0
        self._cache_complete = False  # _manifest_cache lists every readable manifest (writer only)
        self._commit_lock = threading.Lock()  # commits of this object, one at a time (txn.py)
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
        if cls is Repository and backend.exists(ROOT_FILE) and cls._check_root_file(backend).get("tier") == "fast":
            from gpusnap.storage.fast_tier import FastTier

            return FastTier(backend, config)
        if cls is Repository and backend.exists(RANKS):  # it holds distributed checkpoints
            from gpusnap.storage.ranks import RankedRepository

            return RankedRepository(backend, config)
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
    def _io(self, doing: str, path: str, *, writing: bool = False) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            raise storage_error(exc, doing, self.backend.describe(path), writing=writing) from exc

    def _listdir(self, path: str) -> builtins.list[str]:
        """Names under ``path``; a missing directory is empty (object stores have no empty dirs)."""
        try:
            return self.backend.listdir(path)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise storage_error(exc, "listing", self.backend.describe(path), writing=False) from exc

    def _lock(self, *, exclusive: bool, timeout: float) -> BackendLock:
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

    def _confirm_lease(self, doing: str) -> None:
        try:
            self._lease.confirm()
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
        names = [n for n in self._listdir(MANIFESTS) if n.endswith(".json")]
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

    def scan(self) -> tuple[builtins.list[Manifest], builtins.list[UnreadableManifest]]:
        """:meth:`list` and :meth:`unreadable` from one listing of ``manifests/``."""
        return self._scan()

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

    def delete(self, checkpoint_id: str, *, timeout: float = 30.0) -> None:
        """Remove one manifest (the checkpoint disappears); its packs wait for :meth:`gc`.
        A write: it holds the writer lease (waiting up to ``timeout`` for another writer)."""
        if not ID_RE.match(checkpoint_id):
            raise CheckpointNotFoundError(f"no checkpoint {checkpoint_id!r} in {self.root}")
        path = f"{MANIFESTS}/{checkpoint_id}.json"
        self._hold_lease(timeout)
        try:
            with self._io("deleting checkpoint", path):
                if not self.backend.exists(path):
                    raise CheckpointNotFoundError(f"no checkpoint {checkpoint_id!r} in {self.root}")
                self.backend.remove(path)
                if self.config.fsync:
                    self.backend.sync_dir(MANIFESTS)
            with self._mutex:
                self._manifest_cache.pop(f"{checkpoint_id}.json", None)
        finally:
            self._lease.drop()

    # ------------------------------------------------------------------ chunk index

    def _pack_paths(self) -> builtins.list[str]:
        paths: builtins.list[str] = []
        for fan in self._listdir(PACKS):
            if len(fan) != 2:
                continue
            paths.extend(f"{PACKS}/{fan}/{n}" for n in self._listdir(f"{PACKS}/{fan}") if n.endswith(".pack"))
        return paths

    def _refresh_packs(self, errors: builtins.list[tuple[str, str]] | None = None) -> None:
        """Re-list ``packs/``: forget vanished packs (another gc), index new ones from their trailers.

        A damaged trailer is skipped (its chunks count as missing); with ``errors`` given, every
        failure is collected there instead of a backend error being raised.
        """
        with self._refresh_mutex:
            present = self._pack_paths()
            with self._mutex:
                gone = set(self._packs) - set(present)
                for path in gone:
                    del self._packs[path]
                if gone:
                    self._rebuild_chunk_map()
                new = [p for p in present if p not in self._packs]
            for path in new:
                try:
                    index = read_pack_index(self.backend, path)
                except FileNotFoundError:
                    continue
                except IntegrityError as exc:
                    if errors is not None:
                        errors.append((path, str(exc)))
                    continue
                except OSError as exc:
                    err = storage_error(exc, "reading pack index", self.backend.describe(path), writing=False)
                    if errors is None:
                        raise err from exc
                    errors.append((path, str(err)))
                    continue
                self._add_pack(index)

    def _rebuild_chunk_map(self) -> None:
        self._chunks = {}
        for index in self._packs.values():
            map_chunks(self._chunks, index)

    def _add_pack(self, index: PackIndex) -> None:
        with self._mutex:
            self._packs[index.path] = index
            map_chunks(self._chunks, index)

    def _known(self, digest: str) -> bool:
        with self._mutex:
            return digest in self._chunks

    def _locate(self, digest: str, what: str) -> tuple[str, int, int]:
        with self._mutex:
            loc = self._chunks.get(digest)
        if loc is None:
            self._refresh_packs()
            with self._mutex:
                loc = self._chunks.get(digest)
        if loc is None:
            raise IntegrityError(f"chunk {digest}{about(what)} is missing: no pack under {self.root} holds it")
        return loc

    def _forget_pack(self, path: str) -> None:
        self._forget_packs([path])

    def _forget_packs(self, paths: Sequence[str]) -> None:
        with self._mutex:
            if [self._packs.pop(path, None) for path in paths if path in self._packs]:
                self._rebuild_chunk_map()

    # ------------------------------------------------------------------ reading chunks

    def chunk_length(self, digest: str) -> int:
        """Stored length of a chunk (for sizing a :meth:`read_chunk_into` buffer)."""
        return self._locate(digest, "")[2]

    def read_chunk(self, digest: str, *, what: str = "") -> bytes:
        """A chunk's bytes, verified against ``digest``."""
        path, offset, length = self._locate(digest, what)
        try:
            data = self.backend.read_range(path, offset, length)
        except FileNotFoundError:
            # Deleted by a gc elsewhere (the chunk may live in another pack too): look again.
            self._forget_pack(path)
            path, offset, length = self._locate(digest, what)
            try:
                data = self.backend.read_range(path, offset, length)
            except OSError as exc:
                raise self._read_error(exc, path, what) from exc
        except OSError as exc:
            raise self._read_error(exc, path, what) from exc
        self._check(digest, data, path, offset, length, what)
        return data

    def read_chunk_into(self, digest: str, out: memoryview, *, what: str = "", verify: bool = True) -> None:
        """Read a chunk straight into ``out`` (exactly its length), then verify it in place.

        ``verify=False`` skips the digest check (never the length check): for callers that
        chose speed over integrity, e.g. ``restore(..., verify="off")``.
        """
        view = byte_view(out)
        if view.readonly:
            raise ValueError("read_chunk_into needs a writable buffer")
        for attempt in (0, 1):
            path, offset, length = self._locate(digest, what)
            if length != len(view):
                raise IntegrityError(
                    f"chunk {digest}{about(what)} in pack {self.backend.describe(path)} is {length} bytes, "
                    f"the checkpoint expects {len(view)}"
                )
            try:
                got = self.backend.readinto_range(path, offset, view)
            except FileNotFoundError as exc:
                if attempt:
                    raise self._read_error(exc, path, what) from exc
                self._forget_pack(path)
                continue
            except OSError as exc:
                raise self._read_error(exc, path, what) from exc
            if verify:
                self._check(digest, view[:got], path, offset, length, what)
            elif got != length:
                raise IntegrityError(
                    f"chunk {digest}{about(what)} in pack {self.backend.describe(path)} is truncated: "
                    f"{got} of {length} bytes"
                )
            return

    def read_chunks_into(
        self, digests: Sequence[str], out: memoryview, chunk_size: int, *, what: str = "", verify: bool = True
    ) -> ChunkReads:
        """Read consecutive chunks of one span into ``out`` (chunk ``j`` at ``j * chunk_size``).

        Chunks that sit back to back in one pack (a capture writes a span's chunks mostly in
        order) are read with one call per run, so a restore pays one system call per run rather
        than per chunk; the rest (deduplicated chunks, chunks of older packs) are read one by
        one. Each chunk is then checked against its digest (``verify``) or only for its
        length. ``out`` must be exactly the chunks' total length.
        """
        view = byte_view(out)
        if view.readonly:
            raise ValueError("read_chunks_into needs a writable buffer")
        runs = self.chunk_runs(digests, chunk_size, len(view), what=what)
        started = time.perf_counter()
        for path, offset, first, n in runs:
            lo, hi = first * chunk_size, min(len(view), (first + n) * chunk_size)
            try:
                got = self.backend.readinto_range(path, offset, view[lo:hi])
            except FileNotFoundError:
                # Deleted by a gc elsewhere: read chunk by chunk, which looks each one up again.
                self._forget_pack(path)
                for j in range(first, first + n):
                    self.read_chunk_into(
                        digests[j], view[j * chunk_size : min(len(view), (j + 1) * chunk_size)], what=what, verify=False
                    )
                continue
            except OSError as exc:
                raise self._read_error(exc, path, what) from exc
            if got != hi - lo:
                j = first + min(got // chunk_size, n - 1)
                raise IntegrityError(
                    f"chunk {digests[j]}{about(what)} in pack {self.backend.describe(path)} is truncated "
                    f"(read {got} of {hi - lo} bytes of its run)"
                )
        read_s = time.perf_counter() - started
        if verify:
            self.check_runs(digests, view, chunk_size, runs, what=what)
        return ChunkReads(reads=len(runs), read_s=read_s, verify_s=time.perf_counter() - started - read_s)

    def check_runs(
        self, digests: Sequence[str], view: memoryview, chunk_size: int,
        runs: Sequence[tuple[str, int, int, int]], *, what: str = ""
    ) -> None:
        """Check chunks read into ``view`` along ``runs`` (``chunk_runs``) against their
        digests; raises :class:`IntegrityError` at the first that differs."""
        for path, offset, first, n in runs:
            for j in range(first, first + n):
                lo, hi = j * chunk_size, min(len(view), (j + 1) * chunk_size)
                self._check(digests[j], view[lo:hi], path, offset + (j - first) * chunk_size, hi - lo, what)

    def chunk_runs(
        self, digests: Sequence[str], chunk_size: int, nbytes: int, *, what: str = ""
    ) -> builtins.list[tuple[str, int, int, int]]:
        """Where consecutive chunks of one span (``nbytes`` in all, chunk ``j`` at ``j *
        chunk_size``) are stored: ``(pack path, pack offset, first chunk, chunks)`` per run of
        chunks stored back to back. Checks each chunk's stored length."""
        runs: builtins.list[tuple[str, int, int, int]] = []
        for j, digest in enumerate(digests):
            path, offset, length = self._locate(digest, what)
            want = min(chunk_size, nbytes - j * chunk_size)
            if length != want:
                raise IntegrityError(
                    f"chunk {digest}{about(what)} in pack {self.backend.describe(path)} is {length} bytes, "
                    f"the checkpoint expects {want}"
                )
            if runs:
                p, o, first, n = runs[-1]
                if p == path and o + (j - first) * chunk_size == offset and j == first + n:
                    runs[-1] = (p, o, first, n + 1)
                    continue
            runs.append((path, offset, j, 1))
        return runs

    def local_path(self, path: str) -> str | None:
        """The file system path of a pack, for another process to read; None when the
        backend is not a local directory."""
        local = getattr(self.backend, "local_path", None)
        return None if local is None else str(local(path))

    def _read_error(self, exc: OSError, path: str, what: str) -> StorageError:
        doing = f"reading chunk for {what} from pack" if what else "reading chunk from pack"
        return storage_error(exc, doing, self.backend.describe(path), writing=False)

    def _check(self, digest: str, data: bytes | memoryview, path: str, offset: int, length: int, what: str) -> None:
        where = self.backend.describe(path)
        if len(data) != length:
            raise IntegrityError(
                f"chunk {digest}{about(what)} in pack {where} is truncated: {len(data)} of {length} bytes"
            )
        if chunk_digest(data) != digest:
            raise IntegrityError(
                f"chunk {digest}{about(what)} in pack {where} at offset {offset} does not match its digest (corrupt)"
            )

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
                lock = self._lock(exclusive=False, timeout=timeout)
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

    def _pin_known(self, txn: WriteTxn, digest: str) -> bool:
        """Whether ``digest`` is stored; if so, pinned for ``txn`` (gc keeps its pack), in one
        step with gc's choice of packs to delete."""
        with self._mutex:
            if digest in self._chunks:
                txn._pinned.add(digest)
                return True
            return False

    def _pin(self, txn: WriteTxn, digest: str) -> None:
        with self._mutex:
            txn._pinned.add(digest)

    # ------------------------------------------------------------------ gc

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
        try:
            try:
                lock = self._gc_lock(wait)
            except StorageError as exc:
                if blocking:
                    raise
                return GcReport(skipped=True, notes=(str(exc),))
            self._confirm_lease("gc: confirming the writer lease")
            return self._gc_locked(keep_last, fresh, compact=compact, alone=lock is not None, progress=progress)
        finally:
            if lock is not None:
                lock.release()
            self._lease.drop()

    def _has_txns(self) -> bool:
        """Whether a write transaction of this object is open or opening (its shared lock,
        held or wanted, keeps gc from the exclusive one: gc then relies on the pins)."""
        with self._mutex:
            return bool(self._txns) or self._opening > 0

    def _gc_lock(self, timeout: float) -> BackendLock | None:
        """The exclusive root lock, or None while this object's own transactions are open
        (their shared locks exclude it; pins protect them instead)."""
        got: builtins.list[BackendLock] = []

        def attempt() -> bool:
            if self._has_txns():
                return True
            try:
                got.append(self.backend.lock(exclusive=True, timeout=0.0))
                return True
            except TimeoutError:
                return self._has_txns()  # one began meanwhile
            except OSError as exc:
                raise storage_error(exc, "locking", self.backend.describe("lock"), writing=False) from exc

        if not _poll_until(attempt, timeout):
            raise StorageError(
                f"another process holds {self.root} (gc or save in progress, or a verify); "
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
                with self._io("gc: deleting manifest", path):
                    try:
                        freed += self.backend.size(path)
                    except FileNotFoundError:
                        pass
                    self.backend.remove(path)
                deleted_ids.append(m.id)
                self._retired.note(m, keep_last)
            if self.config.fsync:
                with self._io("gc: syncing", MANIFESTS):
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
                    with self._io("gc: deleting pack", index.path):
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

        names = self._listdir(TMP)
        with self._mutex:
            live_tmp = tuple(f"{txn._token}-" for txn in self._txns)
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
            live = {d for txn in self._txns for d in txn._pinned}
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

    # ------------------------------------------------------------------ verify

    def verify(
        self, checkpoint_id: str | None = None, *, progress: Callable[[int], None] | None = None,
        on_total: Callable[[int], None] | None = None,
    ) -> VerifyReport:
        """Re-hash every chunk of one checkpoint (id or tag) or of all (``storage.verify``)."""
        return verify(self, checkpoint_id, progress=progress, on_total=on_total)


def merge_reports(reports: Sequence[GcReport]) -> GcReport:
    """One report of several gc runs (a distributed root's ranks): tuples joined, counts added."""
    tuples = ("deleted_checkpoints", "deleted_packs", "notes", "unreadable", "compacted_packs", "written_packs",
              "problems")
    counts = ("freed_bytes", "rewritten_bytes", "compacted_bytes", "dead_bytes")
    fields: dict[str, Any] = {k: tuple(x for r in reports for x in getattr(r, k)) for k in tuples}
    fields.update({k: sum(getattr(r, k) for r in reports) for k in counts})
    return GcReport(skipped=any(r.skipped for r in reports), **fields)


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

