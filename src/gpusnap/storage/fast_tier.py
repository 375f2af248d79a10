"""The fast tier: checkpoints in host memory that outlives the process, written in place.

A fast root (``/dev/shm/run1``, or a local directory) holds the usual ``manifests/``, the
writer lease and lock, and ``slabs/``: fixed-size files (``Config.fast_slab_bytes``) that a
writer maps once, page-locks once (CUDA) and reuses for every save. The copy engine writes a
save's chunks straight into slab memory, so saving to this tier takes no host copy, no
write system call and no host hash: a chunk's integrity is its device hash (``nh128``, 128
bits, computed on the device at the consistent point: ``kernels/chunk_hash.py``).

A chunk's name in a fast manifest says where it lives and what it hashes to:
``<nh128 hex>@<slab>:<offset>:<length>``; the manifest stores a span's names compactly, as
runs of slab bytes and its hashes in one string (storage/fast_chunks.py). Nothing but
committed manifests records which slab bytes are used: a writer that opens the tier rebuilds the map from them, so a crash
at any moment leaves every committed checkpoint intact and the crashed save's bytes free.
Deduplication is positional, as for incremental saves: a chunk whose device hash the
latest checkpoint holds is named again, not copied (the device hash is trusted for
"unchanged", never across unrelated data: :mod:`gpusnap.kernels.chunk_hash`).

Slab bytes are reused as soon as no retained manifest (nor a save or promotion in flight
here) needs them; a reader in another process that is still reading a checkpoint deleted
meanwhile gets an :class:`IntegrityError` (its chunks' hashes no longer match), never
other bytes silently. The tier survives the process (SIGKILL included), not the machine:
durability is the root it is promoted to.

Parts: slab files and their maps in ``storage.slab_files``, used and free space and
reservations in ``storage.slab_space``, a save's transaction in ``storage.fast_txn``,
names and ranges in ``storage.slab_layout``, verify in ``storage.verify_fast``.
"""


from __future__ import annotations

import builtins
import os
import shutil
import threading
from collections.abc import Callable
from typing import Any

import torch

from gpusnap.config import Config
from gpusnap.errors import CheckpointError, IntegrityError
from gpusnap.kernels.chunk_hash import hex_rows, piece_hashes
from gpusnap.storage.backend import Backend, BackendLock, LocalBackend
from gpusnap.storage.canonical import TreeCodes
from gpusnap.storage.fast_chunks import chunk_location, fast_name
from gpusnap.storage.fast_txn import FastTxn
from gpusnap.storage.host_bytes_hash import hash_host_bytes
from gpusnap.storage.layout import ID_RE, MANIFESTS, ROOT_FILE, TMP, about
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.repository import GcReport, Repository
from gpusnap.storage.slab_files import SlabFiles
from gpusnap.storage.slab_layout import ALIGN, SLABS, add_ranges, merge_ranges, slab_path
from gpusnap.storage.slab_prep import SlabPreparer
from gpusnap.storage.slab_space import SlabSpace
from gpusnap.storage.verify import VerifyReport
from gpusnap.storage.verify_fast import verify_fast

__all__ = ["ALIGN", "SLABS", "FastTier", "FastTxn", "chunk_location", "fast_name", "slab_path"]

# bytes a device check copies and hashes at a time: its scratch on the device, per thread
DEVICE_SLICE_BYTES = 64 << 20

_merge = merge_ranges  # (the names the tier's tests know)
_add_ranges = add_ranges


class FastTier(SlabFiles, SlabSpace, Repository, root_kind="fast"):
    """A fast root (see the module docstring). Thread-safe; the writer maps its slabs.

    >>> import tempfile, os
    >>> tier = FastTier.open(os.path.join(tempfile.mkdtemp(), "fast"), create=True)
    >>> tier.list()
    []
    """

    tier = "fast"

    def __init__(self, backend: Backend, config: Config) -> None:
        super().__init__(backend, config)
        self._alloc = threading.Condition(self._mutex)
        self._slab_sizes: dict[int, int] = {}  # slab -> bytes (files present)
        self._maps: dict[int, Any] = {}  # slab -> MappedMemory (the writer's, kept for its life)
        self._map_lock = threading.Lock()
        self._preparing: dict[int, threading.Event] = {}  # slab -> set once its preparation ends
        self._closed = False  # close() let the maps go: a slab made after it is not kept
        self._preparer = SlabPreparer(self.slab_memory)
        self._used: dict[int, list[tuple[int, int]]] | None = None  # committed ranges, rebuilt lazily
        self._wanted: builtins.list[int] = []  # the slabs the last prepare_ahead asked for
        self._used_generation = 0  # bumped by every commit and forget: a rebuild they overtook is stale
        # manifest id -> (that manifest, its merged slab ranges): each manifest's chunk names
        # are parsed once, not at every rebuild of the used map (which follows every retention)
        self._ranges: dict[str, tuple[Manifest, dict[int, list[tuple[int, int]]]]] = {}
        self._fast_txns: set[FastTxn] = set()
        self._trees = TreeCodes()  # the tree nodes the last commit encoded (used under commit_lock)
        self._pinned_ids: dict[str, int] = {}  # manifest id -> holds (a promotion reading it)
        self._capacity: int | None = None
        self._budget: int | None = None  # slab bytes its writer's checkpoints need (set_budget)
        self.pinned = torch.cuda.is_available()
        self.register_errors: builtins.list[str] = []  # slabs that could not be page-locked
        self.check_device: torch.device | None = None  # where chunks are checked (None: the host; promotion: its GPU)
        # the root directory this object opened: one removed and made again at the same path
        # (a cleaned /dev/shm, another run) is another tier, whose slab files are not ours
        self._identity = self._root_identity()

    # ------------------------------------------------------------------ layout

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
        durable_root: str | None = None,
    ) -> FastTier:
        """Open (or with ``create=True`` initialise) the fast root at ``root``: a local path.

        ``durable_root``: the root its checkpoints are promoted to. A fast root belongs to one
        durable root (recorded when it is made): another one's is refused. ``root_doc``: more
        root-file fields for a root made here (its kind is always ``fast``)."""
        text = os.fspath(root)
        if "://" in text and not text.startswith("file://"):
            raise ValueError(f"fast_root must be a local path (host memory such as /dev/shm/run), not {text!r}")
        text = text.removeprefix("file://")
        repo = Repository.open(text, create=create, config=config, backend=backend or LocalBackend(text, what="the fast root"),
                               root_doc={**(root_doc or {}), "tier": "fast"} if durable_root is None else
                               {**(root_doc or {}), "tier": "fast", "durable_root": durable_root})
        if not isinstance(repo, FastTier):
            raise CheckpointError(f"{text} is a durable checkpoint root, not a fast tier: give fast_root its own directory")
        owner = repo.durable_root
        if durable_root is not None and owner is not None and owner != durable_root:
            raise CheckpointError(
                f"the fast root {text} belongs to the durable root {owner}, not {durable_root}: two runs cannot share "
                "a fast root (each would read and delete the other's checkpoints); give this run a fast_root of its own"
            )
        if create:
            with repo.io_errors("creating", SLABS, writing=True):
                repo.backend.makedirs(SLABS)
        return repo

    @property
    def durable_root(self) -> str | None:
        """The durable root this fast root belongs to (None: made before gpusnap recorded it)."""
        try:
            owner = self._check_root_file(self.backend).get("durable_root")
        except (OSError, CheckpointError):
            return None
        return owner if isinstance(owner, str) else None

    @property
    def identity(self) -> tuple[int, int] | None:
        """The root directory this object opened, as (device, inode): another object of the
        same tier (a promotion helper's) must see the same."""
        return self._identity

    def intact(self) -> bool:
        """Whether the root this object opened is still there (removed, or removed and made
        again by someone else: the writer starts a new tier)."""
        try:
            return self.backend.exists(ROOT_FILE) and self._root_identity() == self._identity
        except OSError:
            return False

    def _root_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.backend.local_path(""))  # type: ignore[attr-defined]
        except (OSError, AttributeError):
            return None
        return st.st_dev, st.st_ino


    # ------------------------------------------------------------------ chunks

    def _refresh_packs(self, errors: builtins.list[tuple[str, str]] | None = None) -> None:
        return  # no packs: a chunk's name is its location

    def is_stored(self, digest: str) -> bool:
        return self._named(digest)

    def _named(self, name: str) -> bool:
        """Whether a retained manifest names chunk ``name`` (so its bytes are still there)."""
        used = self._used_map()
        try:
            _h, slab, off, n = chunk_location(name)
        except IntegrityError:
            return False
        return any(lo <= off and off + n <= hi for lo, hi in used.get(slab, ()))

    def _locate(self, digest: str, what: str) -> tuple[str, int, int]:
        _h, slab, off, n = chunk_location(digest)
        return slab_path(slab), off, n

    def check_chunk(self, digest: str, data: bytes | memoryview, path: str, offset: int, length: int, what: str,
               device: torch.device | None = None) -> None:
        where = self.backend.describe(path)
        if len(data) != length:
            raise IntegrityError(f"chunk {digest}{about(what)} in slab {where} is truncated: {len(data)} of {length} bytes")
        want = chunk_location(digest)[0]
        padded = max(16, -(-length // 16) * 16)
        if self._hashes(data, padded, device) != [want]:
            raise self._mismatch(digest, what, path, offset)

    def _hashes(self, data: memoryview | bytes, chunk_size: int, device: torch.device | None) -> builtins.list[str]:
        device = device if device is not None else self.check_device
        try:  # (a device's scratch: one slice at a time, however long the run)
            return hash_host_bytes(data, chunk_size, device, slice_bytes=DEVICE_SLICE_BYTES)
        except RuntimeError:  # (the device is out of memory, say): the host computes the same bits
            if device is None:
                raise
            return hash_host_bytes(data, chunk_size, None)

    def _mismatch(self, name: str, what: str, path: str, offset: int) -> IntegrityError:
        return IntegrityError(
            f"chunk {name}{about(what)} in slab {self.backend.describe(path)} at offset {offset} does not match its "
            "hash (corrupt, or reused after its checkpoint was deleted)"
        )

    def check_run(self, names: builtins.list[str], chunk_size: int, device: torch.device | None = None) -> None:
        """Check chunks that lie back to back in one slab, each ``chunk_size`` bytes, with one
        hash pass over their bytes (on ``device``: one host-to-device copy and one launch for
        the run, not one a chunk); IntegrityError naming the first that does not match."""
        slab, lo, hi = self._run_range(names, chunk_size)
        self.check_bytes(names, self._slab_bytes(slab, lo, hi), chunk_size, device)

    def run_view(self, names: builtins.list[str], chunk_size: int) -> memoryview:
        """The bytes of a run (as :meth:`check_run` takes it) in this process's map of its
        slab, not copied (a promotion writes from them, then checks them); the caller keeps
        its checkpoint pinned while it reads."""
        slab, lo, hi = self._run_range(names, chunk_size)
        return self._slab_bytes(slab, lo, hi)

    def check_bytes(self, names: builtins.list[str], data: memoryview | bytes, chunk_size: int,
                    device: torch.device | None = None) -> None:
        """Check ``data``, the bytes of the run ``names`` (read by the caller), against the
        chunks' device hashes; IntegrityError naming the first that does not match."""
        slab, lo, hi = self._run_range(names, chunk_size)
        if len(names) == 1:
            self.check_chunk(names[0], data, slab_path(slab), lo, hi - lo, "", device=device)
            return
        got = self._hashes(data, chunk_size, device)
        for i, name in enumerate(names):
            if got[i] != chunk_location(name)[0]:
                raise self._mismatch(name, "", slab_path(slab), lo + i * chunk_size)

    def copy_checked(self, names: builtins.list[str]) -> bytearray:
        """The bytes of chunks ``names`` (each anywhere in the tier, none empty) copied back
        to back into memory of this process, then checked against their device hashes on
        the host, in one pass for them all (:func:`~gpusnap.kernels.chunk_hash.piece_hashes`);
        IntegrityError naming the first that does not match. Bytes written from the copy are
        the bytes checked: nothing can change them in between. Meant for small chunks (the
        host hashes them); the caller keeps their checkpoint pinned while this reads."""
        where = [chunk_location(name) for name in names]
        out: bytearray | None = bytearray(sum(n for *_x, n in where))
        view, at, pieces = memoryview(out), 0, []
        try:
            for _h, slab, offset, n in where:
                view[at : at + n] = self._slab_bytes(slab, offset, offset + n)
                pieces.append(view[at : at + n])
                at += n
            got = hex_rows(piece_hashes(pieces).numpy()) if pieces else []
        finally:
            for piece in pieces:
                piece.release()  # (exports of the bytearray: none may outlive this call)
            view.release()
        bad = next(((name, slab, offset) for name, (want, slab, offset, _n), digest in zip(names, where, got)
                    if digest != want), None)
        if bad is not None:
            out = None  # (a failure is kept until raised: not with this copy held by its traceback)
            raise self._mismatch(bad[0], "", slab_path(bad[1]), bad[2])
        return out

    @staticmethod
    def _run_range(names: builtins.list[str], chunk_size: int) -> tuple[int, int, int]:
        """``(slab, lo, hi)`` of a run: one chunk, or whole chunks back to back in one slab."""
        first, last = chunk_location(names[0]), chunk_location(names[-1])
        slab, lo, hi = first[1], first[2], last[2] + last[3]
        if len(names) > 1 and (last[1] != slab or hi - lo != len(names) * chunk_size):
            raise ValueError("a run is one chunk or chunks that lie back to back, each chunk_size bytes")
        return slab, lo, hi


    def _has_txns(self) -> bool:
        with self._mutex:  # (a fast save's reserved and reused ranges protect it from gc)
            return bool(self._fast_txns) or super()._has_txns()


    # ------------------------------------------------------------------ pins (promotion)

    def pin_checkpoint(self, checkpoint_id: str) -> None:
        """Keep ``checkpoint_id`` (and its slab bytes) through retention until unpinned."""
        with self._alloc:
            self._pinned_ids[checkpoint_id] = self._pinned_ids.get(checkpoint_id, 0) + 1

    def unpin_checkpoint(self, checkpoint_id: str) -> None:
        with self._alloc:
            left = self._pinned_ids.get(checkpoint_id, 0) - 1
            if left > 0:
                self._pinned_ids[checkpoint_id] = left
            else:
                self._pinned_ids.pop(checkpoint_id, None)
            self._alloc.notify_all()

    def read_view(self, name: str) -> memoryview:
        """The bytes of chunk ``name`` in this process's map of its slab (no copy); the
        caller keeps its checkpoint pinned while it reads."""
        _h, slab, off, n = chunk_location(name)
        return self._slab_bytes(slab, off, off + n)


    # ------------------------------------------------------------------ writing

    def begin_write(self, *, timeout: float = 60.0) -> FastTxn:  # type: ignore[override]  (FastTxn: no WriteTxn)
        return super().begin_write(timeout=timeout)  # type: ignore[return-value]

    def _new_txn(self, lock: BackendLock) -> FastTxn:  # type: ignore[override]
        self._used_map()  # (raises while a manifest is unreadable: its bytes' use is unknown)
        return FastTxn(self, lock)

    # ------------------------------------------------------------------ for its transactions

    def txn_opened(self, txn: Any) -> None:
        """Register ``txn``: its reserved and reused ranges are busy, its ``tmp/`` files kept."""
        with self._alloc:
            self._fast_txns.add(txn)

    def txn_closed(self, txn: Any) -> bool:
        """``txn`` committed or aborted: its ranges are free (unless its manifest names them).
        Whether it was open (its lease hold then goes: :meth:`drop_lease_hold`)."""
        with self._alloc:
            registered = txn in self._fast_txns
            self._fast_txns.discard(txn)
            self._alloc.notify_all()
        return registered

    def keep_reused(self, txn: FastTxn, chunks: dict[int, str]) -> dict[int, str]:
        """Of ``chunks`` (index -> fast name), those still stored, held for ``txn`` (its
        ``held`` ranges) in one step with retention's choice of what to free."""
        out: dict[int, str] = {}
        with self._alloc:
            for k, name in chunks.items():
                if name in txn.reused or self._named(name):
                    _h, slab, off, n = chunk_location(name)
                    txn.held.append((slab, off, off + n))
                    txn.reused.add(name)
                    out[k] = name
        return out

    def publish(self, token: str, manifest: Manifest, placed: dict[int, builtins.list[tuple[int, int]]] | None) -> None:
        """Commit ``manifest`` (its chunks' bytes are in the slabs already) through
        ``tmp/<token>-<id>.json``; its ranges (``placed``: as its save worked them out, else
        parsed from it) become used."""
        if not ID_RE.match(manifest.id):
            raise CheckpointError(f"checkpoint id {manifest.id!r} is not a safe file name")
        with self.commit_lock:
            self.confirm_lease("confirming the writer lease")
            self.refuse_taken_tag(manifest)
            final = f"{MANIFESTS}/{manifest.id}.json"
            tmp = f"{TMP}/{token}-{manifest.id}.json"
            with self.io_errors("writing manifest", tmp, writing=True):
                handle = self.backend.open_write(tmp)
                try:
                    handle.write(manifest.to_json(self._trees))
                finally:
                    handle.close(sync=self.config.fsync)
            with self.io_errors("publishing manifest", final, writing=True):
                self.backend.rename(tmp, final)
            self._add_committed(manifest, placed)

    def _gc_locked(self, keep_last: int | None, fresh: bool = True, *, compact: bool = False,
                   alone: bool = False, progress: Callable[[int], Callable[[int], None]] | None = None) -> GcReport:
        """Delete the oldest checkpoints beyond ``keep_last`` (not those a promotion reads);
        their slab bytes become free. Slab files are kept: the next save reuses them, so there
        is nothing to compact (``compact``, ``alone`` and ``progress`` are ignored)."""
        manifests, bad = self._scan(fresh=fresh)
        deleted: builtins.list[str] = []
        freed = 0
        if keep_last is not None and len(manifests) > keep_last:
            with self._mutex:
                pinned = set(self._pinned_ids)
            for m in manifests[: len(manifests) - keep_last]:
                if m.id in pinned:
                    continue
                path = f"{MANIFESTS}/{m.id}.json"
                with self.io_errors("gc: deleting manifest", path):
                    try:
                        self.backend.remove(path)
                    except FileNotFoundError:
                        continue
                deleted.append(m.id)
                freed += m.nbytes
            with self._mutex:
                for cid in deleted:
                    self._manifest_cache.pop(f"{cid}.json", None)
                    self._ranges.pop(cid, None)
        self._forget_used()
        try:  # rebuilt here, on the thread that retains, rather than in the next save()'s stall
            self._used_map()
        except CheckpointError:
            pass  # (an unreadable manifest: the next save's reservation raises it)
        for name in self.listdir(TMP):
            with self._mutex:
                live = tuple(f"{t.token}-" for t in self._fast_txns)
            if not name.startswith(live):
                try:
                    self.backend.remove(f"{TMP}/{name}")
                except OSError:
                    pass
        notes = (f"{len(bad)} unreadable manifest(s) kept",) if bad else ()
        return GcReport(tuple(deleted), (), freed, False, notes, tuple(bad))

    def verify(
        self, checkpoint_id: str | None = None, *, progress: Callable[[int], None] | None = None,
        on_total: Callable[[int], None] | None = None,
    ) -> VerifyReport:
        """Re-read every chunk of one checkpoint (id or tag) or of all from its slab and check
        its device hash (``storage.verify_fast``)."""
        return verify_fast(self, checkpoint_id, progress, on_total)

    def remove_all(self) -> None:
        """Delete this tier, its root directory included (the memory tier of a Checkpointer
        that closed cleanly). Only its writer may: a process still reading keeps its maps."""
        if not self.is_writer:
            raise CheckpointError(f"only the fast tier's writer may remove {self.backend.describe('')}")
        shutil.rmtree(self.backend.local_path(""))  # type: ignore[attr-defined]

    def delete(self, checkpoint_id: str, *, timeout: float = 30.0) -> None:
        super().delete(checkpoint_id, timeout=timeout)
        with self._mutex:
            self._ranges.pop(checkpoint_id, None)
        self._forget_used()
