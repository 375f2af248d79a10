"""The fast tier: checkpoints in host memory that outlives the process, written in place.

A fast root (``/dev/shm/run1``, or a local directory) holds the usual ``manifests/``, the
writer lease and lock, and ``slabs/``: fixed-size files (``Config.fast_slab_bytes``) that a
writer maps once, page-locks once (CUDA) and reuses for every save. The copy engine writes a
save's chunks straight into slab memory, so saving to this tier takes no host copy, no
write system call and no host hash: a chunk's integrity is its device hash (``nh128``, 128
bits, computed on the device at the consistent point: ``kernels/chunk_hash.py``).

A chunk's name in a fast manifest says where it lives and what it hashes to:
``<nh128 hex>@<slab>:<offset>:<length>``; the manifest stores a span's names compactly, as
runs of slab bytes and its hashes in one string (storage/fast_chunks.py). Nothing but committed manifests records which
slab bytes are used: a writer that opens the tier rebuilds the map from them, so a crash
at any moment leaves every committed checkpoint intact and the crashed save's bytes free.
Deduplication is positional, as for incremental saves: a chunk whose device hash the
latest checkpoint holds is named again, not copied (the device hash is trusted for
"unchanged", never across unrelated data: :mod:`gpusnap.kernels.chunk_hash`).

Slab bytes are reused as soon as no retained manifest (nor a save or promotion in flight
here) needs them; a reader in another process that is still reading a checkpoint deleted
meanwhile gets an :class:`IntegrityError` (its chunks' hashes no longer match), never
other bytes silently. The tier survives the process (SIGKILL included), not the machine:
durability is the root it is promoted to.
"""

from __future__ import annotations

import builtins
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gpusnap.config import Config
from gpusnap.errors import CheckpointError, IntegrityError, StorageError
from gpusnap.storage.backend import Backend, BackendLock, LocalBackend
from gpusnap.storage.canonical import TreeCodes
from gpusnap.storage.fast_chunks import FastChunks, chunk_location, fast_name, merged_ranges
from gpusnap.storage.host_bytes_hash import hash_host_bytes
from gpusnap.storage.layout import ID_RE, MANIFESTS, ROOT_FILE, TMP, storage_error
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.private_dir import open_private
from gpusnap.storage.repository import GcReport, Repository, about
from gpusnap.storage.slab_prep import SlabPreparer

__all__ = ["SLABS", "FastTier", "FastTxn", "chunk_location", "fast_name"]

SLABS = "slabs"
_SLAB_ROUND = 2 << 20  # slab sizes are whole 2 MiB (huge-page friendly)
ALIGN = 4096  # each region starts on a page: DMA-friendly, and no two saves share a page


def slab_path(slab: int) -> str:
    return f"{SLABS}/{slab:06d}.slab"


@dataclass
class _Extent:
    """Reserved slab bytes ``[lo, hi)`` a save carves its regions from (``cursor`` onward)."""

    slab: int
    lo: int
    hi: int
    cursor: int


class FastTier(Repository):
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
        self._preparer = SlabPreparer(self._slab_memory)
        self._used: dict[int, list[tuple[int, int]]] | None = None  # committed ranges, rebuilt lazily
        self._wanted: builtins.list[int] = []  # the slabs the last prepare_ahead asked for
        self._used_generation = 0  # bumped by every commit and forget: a rebuild they overtook is stale
        # manifest id -> (that manifest, its merged slab ranges): each manifest's chunk names
        # are parsed once, not at every rebuild of the used map (which follows every retention)
        self._ranges: dict[str, tuple[Manifest, dict[int, list[tuple[int, int]]]]] = {}
        self._fast_txns: set[FastTxn] = set()
        self._trees = TreeCodes()  # the tree nodes the last commit encoded (used under _commit_lock)
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
    def open(  # type: ignore[override]
        cls,
        root: str | os.PathLike[str],
        *,
        create: bool = False,
        storage_options: dict[str, Any] | None = None,
        config: Config | None = None,
        backend: Backend | None = None,
        durable_root: str | None = None,
    ) -> FastTier:
        """Open (or with ``create=True`` initialise) the fast root at ``root``: a local path.

        ``durable_root``: the root its checkpoints are promoted to. A fast root belongs to one
        durable root (recorded when it is made): another one's is refused."""
        text = os.fspath(root)
        if "://" in text and not text.startswith("file://"):
            raise ValueError(f"fast_root must be a local path (host memory such as /dev/shm/run), not {text!r}")
        text = text.removeprefix("file://")
        repo = Repository.open(text, create=create, config=config, backend=backend or LocalBackend(text, what="the fast root"),
                               root_doc={"tier": "fast"} if durable_root is None else
                               {"tier": "fast", "durable_root": durable_root})
        if not isinstance(repo, FastTier):
            raise CheckpointError(f"{text} is a durable checkpoint root, not a fast tier: give fast_root its own directory")
        owner = repo.durable_root
        if durable_root is not None and owner is not None and owner != durable_root:
            raise CheckpointError(
                f"the fast root {text} belongs to the durable root {owner}, not {durable_root}: two runs cannot share "
                "a fast root (each would read and delete the other's checkpoints); give this run a fast_root of its own"
            )
        if create:
            with repo._io("creating", SLABS, writing=True):
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

    def _slab_list(self) -> dict[int, int]:
        sizes: dict[int, int] = {}
        for name in self._listdir(SLABS) if self.backend.exists(SLABS) else []:
            if name.endswith(".slab") and name[:-5].isdigit():
                sizes[int(name[:-5])] = self.backend.size(f"{SLABS}/{name}")
        return sizes

    # ------------------------------------------------------------------ chunks

    def _refresh_packs(self, errors: builtins.list[tuple[str, str]] | None = None) -> None:
        return  # no packs: a chunk's name is its location

    def _known(self, digest: str) -> bool:
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

    def _check(self, digest: str, data: bytes | memoryview, path: str, offset: int, length: int, what: str,
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
        try:
            return hash_host_bytes(data, chunk_size, device)
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

    def copy_run(self, names: builtins.list[str], chunk_size: int, out: torch.Tensor) -> memoryview:
        """The bytes of a run (as :meth:`check_run` takes it) copied once into ``out`` (a host
        uint8 tensor at least that long; the copy lets the interpreter lock go): what a
        promotion checks, digests and writes, so that all three see the same bytes even if
        the slab changes meanwhile."""
        slab, lo, hi = self._run_range(names, chunk_size)
        source = torch.frombuffer(self._slab_bytes(slab, lo, hi), dtype=torch.uint8)
        out[: hi - lo].copy_(source)
        return memoryview(out[: hi - lo].numpy()).cast("B")

    def check_bytes(self, names: builtins.list[str], data: memoryview | bytes, chunk_size: int,
                    device: torch.device | None = None) -> None:
        """Check ``data``, the bytes of the run ``names`` (read by the caller), against the
        chunks' device hashes; IntegrityError naming the first that does not match."""
        slab, lo, hi = self._run_range(names, chunk_size)
        if len(names) == 1:
            self._check(names[0], data, slab_path(slab), lo, hi - lo, "", device=device)
            return
        got = self._hashes(data, chunk_size, device)
        for i, name in enumerate(names):
            if got[i] != chunk_location(name)[0]:
                raise self._mismatch(name, "", slab_path(slab), lo + i * chunk_size)

    @staticmethod
    def _run_range(names: builtins.list[str], chunk_size: int) -> tuple[int, int, int]:
        """``(slab, lo, hi)`` of a run: one chunk, or whole chunks back to back in one slab."""
        first, last = chunk_location(names[0]), chunk_location(names[-1])
        slab, lo, hi = first[1], first[2], last[2] + last[3]
        if len(names) > 1 and (last[1] != slab or hi - lo != len(names) * chunk_size):
            raise ValueError("a run is one chunk or chunks that lie back to back, each chunk_size bytes")
        return slab, lo, hi

    # ------------------------------------------------------------------ space

    def _used_map(self) -> dict[int, builtins.list[tuple[int, int]]]:
        """Slab ranges named by retained manifests (merged, sorted), from a fresh scan once.

        A scan that a commit (or a forget) overtook is done again: the commit, finding no map
        to add its ranges to, relies on the rebuild's listing, which may predate its manifest."""
        while True:
            with self._mutex:
                if self._used is not None:
                    return self._used
                generation = self._used_generation
            merged = self._scan_used()
            with self._mutex:
                if self._used_generation == generation:
                    self._used = merged
                    return merged

    def _scan_used(self) -> dict[int, builtins.list[tuple[int, int]]]:
        manifests, bad = self._scan()
        if bad:
            raise CheckpointError(
                f"the fast tier {self.root} has {len(bad)} unreadable manifest(s) ({bad[0].path}: {bad[0].reason}): "
                "which slab bytes they use is unknown, so nothing is written there; delete them"
            )
        used: dict[int, builtins.list[tuple[int, int]]] = {}
        for m in manifests:
            for slab, ranges in self._ranges_of(m).items():
                used.setdefault(slab, []).extend(ranges)
        return {s: _merge(r) for s, r in used.items()}

    def _ranges_of(self, manifest: Manifest,
                   placed: dict[int, builtins.list[tuple[int, int]]] | None = None) -> dict[int, builtins.list[tuple[int, int]]]:
        """The slab ranges ``manifest``'s chunks lie in (merged: a save's regions are mostly
        contiguous, so these are few), parsed once per manifest object; ``placed``: those
        ranges, as the save that wrote the manifest worked them out."""
        with self._mutex:
            known = self._ranges.get(manifest.id)
        if known is not None and known[0] is manifest:
            return known[1]
        if placed is not None:
            merged = placed
        else:
            ranges: dict[int, builtins.list[tuple[int, int]]] = {}
            _add_ranges(ranges, manifest)
            merged = {s: _merge(r) for s, r in ranges.items()}
        with self._mutex:
            self._ranges[manifest.id] = (manifest, merged)
        return merged

    def _forget_used(self) -> None:
        with self._alloc:
            self._used = None
            self._used_generation += 1
            self._alloc.notify_all()

    def capacity(self) -> int:
        """Slab bytes this tier may hold: ``Config.fast_tier_bytes``, else what its writer's
        checkpoints need (:meth:`set_budget`; never less than the slabs already there), else,
        for a tier used without a budget, 90% of its file system's free space."""
        with self._mutex:
            if self.config.fast_tier_bytes:
                return self.config.fast_tier_bytes
            if self._budget is not None:
                return self._budget
            if self._capacity is None:
                st = os.statvfs(self.backend.local_path(""))  # type: ignore[attr-defined]
                self._capacity = sum(self._slab_list().values()) + int(st.f_bavail * st.f_frsize * 0.9)
            return self._capacity

    def per_save(self, need: int, piece: int) -> int:
        """Slab bytes one save of ``need`` bytes in pieces of at most ``piece`` may take: a
        piece never straddles a slab's end, so each slab a save spans may leave a piece unused."""
        return need + -(-need // (self.config.fast_slab_bytes - piece)) * piece

    def set_budget(self, saves: int, need: int, piece: int) -> int:
        """Bound the tier to ``saves`` checkpoints of ``need`` bytes (whole 2 MiB slab steps);
        returns the bound. A StorageError naming the size needed when its file system cannot
        hold that beside the slabs already there (checked when the bound grows)."""
        budget = saves * -(-self.per_save(need, piece) // _SLAB_ROUND) * _SLAB_ROUND
        if self.config.fast_tier_bytes:
            return self.config.fast_tier_bytes
        with self._mutex:
            if self._budget is not None and budget <= self._budget:
                return self._budget
            have = sum(self._slab_list().values())
        more = budget - have
        if more > 0:
            try:
                st = os.statvfs(self.backend.local_path(""))  # type: ignore[attr-defined]
                free = st.f_bavail * st.f_frsize
            except (OSError, AttributeError):
                free = more
            if free < more:
                raise StorageError(
                    f"the fast tier {self.root} needs {budget} bytes of slabs for {saves} checkpoints of {need} bytes "
                    f"(fast_keep_last + 2: those kept, the one being written and one in promotion); it holds {have} "
                    f"and its file system has {free} bytes free: free space there (a container's /dev/shm: "
                    "--shm-size), lower fast_keep_last, or pick another fast_root; nothing was saved"
                )
        with self._mutex:  # (slabs an earlier, larger state left are reused, not removed)
            self._budget = max(budget, have, self._budget or 0)
            return self._budget

    def _has_txns(self) -> bool:
        with self._mutex:  # (a fast save's reserved and reused ranges protect it from gc)
            return bool(self._fast_txns) or super()._has_txns()

    def _busy_ranges(self) -> dict[int, builtins.list[tuple[int, int]]]:
        busy = {s: list(r) for s, r in self._used_map().items()}
        for txn in self._fast_txns:
            for e in txn.extents:
                busy.setdefault(e.slab, []).append((e.lo, e.hi))
            for slab, lo, hi in txn.held:
                busy.setdefault(slab, []).append((lo, hi))
        return {s: _merge(r) for s, r in busy.items()}

    def _reserve(self, txn: FastTxn, nbytes: int, piece: int) -> bool:
        """Reserve room for ``nbytes`` in pieces of at most ``piece`` bytes; all or nothing."""
        with self._alloc:
            if self._slab_sizes == {}:
                self._slab_sizes = self._slab_list()
            busy = self._busy_ranges()
            free: builtins.list[tuple[int, int, int]] = []
            for slab, size in sorted(self._slab_sizes.items()):
                at = 0
                for lo, hi in [*busy.get(slab, []), (size, size)]:
                    start = -(-at // ALIGN) * ALIGN
                    if lo - start >= min(piece, ALIGN):
                        free.append((slab, start, lo))
                    at = max(at, hi)
            taken: builtins.list[_Extent] = []
            room = 0
            for slab, lo, hi in sorted(free, key=lambda f: f[1] - f[2]):  # largest first
                if room >= nbytes:
                    break
                taken.append(_Extent(slab, lo, hi, lo))
                room += max(0, hi - lo - piece)  # a piece that does not fit wastes the tail
            slab_bytes = self.config.fast_slab_bytes
            total = sum(self._slab_sizes.values())
            sizes: dict[int, int] = {}
            while room < nbytes:
                # whole slabs, and a last one no larger than the rest needs (a small state
                # must not cost a GiB of memory and its page-locking)
                size = min(slab_bytes, -(-(nbytes - room + piece) // _SLAB_ROUND) * _SLAB_ROUND)
                if total + size > self.capacity():
                    return False
                slab = max([*self._slab_sizes, *sizes, -1]) + 1
                sizes[slab] = size
                total += size
                taken.append(_Extent(slab, 0, size, 0))
                room += size - piece
            self._slab_sizes.update(sizes)  # the files are made by the copier (FastTxn.take)
            txn.extents = taken
            return True

    def _wait_for_room(self, timeout: float | None) -> bool:
        """Wait until a transaction or promotion here ends (room may have come back)."""
        with self._alloc:
            if not self._fast_txns and not self._pinned_ids:
                return False
            return self._alloc.wait(timeout)

    def _slab_memory(self, slab: int) -> torch.Tensor:
        """Slab ``slab`` mapped (created first if new), page-locked where CUDA is available.

        One thread prepares a slab; a thread that wants one being prepared (the copier, a
        slab the background preparer has in hand) waits for it, and tries itself if that
        preparation failed (its own error is then the one raised)."""
        while True:
            with self._map_lock:
                mapped = self._maps.get(slab)
                if mapped is not None:
                    return mapped.tensor
                busy = self._preparing.get(slab)
                if busy is None:
                    busy = self._preparing[slab] = threading.Event()
                    break
            busy.wait()
        try:
            if self._root_identity() != self._identity:  # (never map another tier's file as ours)
                raise StorageError(
                    f"the fast tier {self.root} was removed: slab {slab} of the tier this process opened is gone "
                    "(its checkpoints with it)"
                )
            mapped = self._make_slab(slab)
            with self._map_lock:
                if not self._closed:  # (closed meanwhile: the caller's tensor keeps it while used)
                    self._maps[slab] = mapped
            self._preparer.made(slab)  # (by whoever: an earlier failure of it is over)
            return mapped.tensor
        finally:
            with self._map_lock:
                self._preparing.pop(slab, None)
            busy.set()

    def _make_slab(self, slab: int) -> Any:
        from gpusnap.host_map import MappedMemory

        with self._mutex:
            size = self._slab_sizes[slab]
        path = self.backend.local_path(slab_path(slab))  # type: ignore[attr-defined]
        with self._io("creating slab", slab_path(slab), writing=True):
            fd = open_private(path, os.O_RDWR | os.O_CREAT)  # (never a planted link, nor another user's file)
            try:
                if os.fstat(fd).st_size < size:
                    # allocates every page now: a full tmpfs is ENOSPC here, not SIGBUS at a copy
                    os.posix_fallocate(fd, 0, size)
            except BaseException:
                os.close(fd)
                raise
        try:
            try:
                return MappedMemory(fd, size, pinned=self.pinned)
            except RuntimeError as exc:  # page-locking refused: copies go through pageable memory
                self.register_errors.append(f"slab {slab}: {exc}")
                return MappedMemory(open_private(path, os.O_RDWR), size, pinned=False)
        except OSError as exc:
            raise storage_error(exc, "mapping slab", self.backend.describe(slab_path(slab)), writing=True) from exc

    def prepare_for(self, saves: int, need: int, piece: int) -> int:
        """:meth:`prepare_ahead` for ``saves`` saves of ``need`` bytes copied in pieces of at
        most ``piece`` bytes (:meth:`per_save`, as :meth:`_reserve` counts it)."""
        return self.prepare_ahead(saves * self.per_save(need, piece))

    def slab_bytes(self) -> int:
        """Bytes of the slab files this tier holds (its host memory, on a tmpfs)."""
        with self._mutex:
            if not self._slab_sizes:
                self._slab_sizes = self._slab_list()
            return sum(self._slab_sizes.values())

    def prepare_ahead(self, nbytes: int) -> int:
        """Have slabs of ``nbytes`` in all (within :meth:`capacity`), and prepare every slab
        not mapped yet on a background thread, lowest first: the saves that follow find their
        memory created, mapped and page-locked. Returns the bytes of slabs it set aside.

        Creating and page-locking costs the program ~70 ms of training per GiB whenever it
        is done (the kernel populating tmpfs pages); done ahead, no save waits for it."""
        with self._alloc:
            if not self._slab_sizes:
                self._slab_sizes = self._slab_list()
            total = sum(self._slab_sizes.values())
            added = 0
            while total < nbytes:
                size = min(self.config.fast_slab_bytes, -(-(nbytes - total) // _SLAB_ROUND) * _SLAB_ROUND)
                if total + size > self.capacity():
                    break
                slab = max([*self._slab_sizes, -1]) + 1
                self._slab_sizes[slab] = size
                total += size
                added += size
            # the lowest slabs that hold ``nbytes``, no more (a larger state's slabs, left by an
            # earlier run, are made ready only when a reservation takes them); an empty file
            # (a writer killed between creating and allocating it) holds nothing
            wanted, held = [], 0
            for slab, size in sorted(self._slab_sizes.items()):
                if held >= nbytes:
                    break
                if size:
                    wanted.append(slab)
                    held += size
        with self._map_lock:
            todo = [s for s in wanted if s not in self._maps]
            self._wanted = wanted
        if todo:
            self._preparer.want(todo)
        return added

    def prepared_bytes(self) -> int:
        """Slab bytes this process has mapped (page-locked where CUDA is available)."""
        with self._map_lock:
            return sum(m.nbytes for m in self._maps.values())

    def wait_prepared(self, timeout: float | None = None) -> None:
        """Wait for the slabs set aside to be made; a StorageError lists those that failed
        (a save that needs one makes it itself, and fails with the cause if it recurs)."""
        self._preparer.join(timeout)
        with self._map_lock:  # (the slabs the last prepare_ahead wanted and nobody has made)
            missing = {f"slab {n}: " for n in self._wanted if n not in self._maps}
        errors = [e for e in self._preparer.errors if e[: e.index(":") + 2] in missing]
        if errors:
            raise StorageError(f"the fast tier {self.root} could not prepare {len(errors)} slab(s): {'; '.join(errors)}")

    def unprepared(self, slabs: builtins.list[int]) -> bool:
        """Whether any of ``slabs`` is not mapped yet (a save taking it would wait for it)."""
        with self._map_lock:
            return any(s not in self._maps for s in slabs)

    def close(self) -> None:
        """Release the lease and let go of the slab maps (each is unmapped once no tensor over
        it is left: a save or reader still using one keeps it); the preparer stops."""
        self._preparer.stop()
        with self._map_lock:
            self._closed = True
            self._maps.clear()
        super().close()

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

    def _slab_bytes(self, slab: int, lo: int, hi: int) -> memoryview:
        with self._mutex:
            if slab not in self._slab_sizes:  # (a slab another writer made)
                self._slab_sizes.update(self._slab_list())
        return memoryview(self._slab_memory(slab)[lo:hi].numpy()).cast("B")

    # ------------------------------------------------------------------ writing

    def begin_write(self, *, timeout: float = 60.0) -> FastTxn:  # type: ignore[override]
        return super().begin_write(timeout=timeout)  # type: ignore[return-value]

    def _new_txn(self, lock: BackendLock) -> FastTxn:  # type: ignore[override]
        self._used_map()  # (raises while a manifest is unreadable: its bytes' use is unknown)
        return FastTxn(self, lock)

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
                with self._io("gc: deleting manifest", path):
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
        for name in self._listdir(TMP):
            with self._mutex:
                live = tuple(f"{t.token}-" for t in self._fast_txns)
            if not name.startswith(live):
                try:
                    self.backend.remove(f"{TMP}/{name}")
                except OSError:
                    pass
        notes = (f"{len(bad)} unreadable manifest(s) kept",) if bad else ()
        return GcReport(tuple(deleted), (), freed, False, notes, tuple(bad))

    def delete(self, checkpoint_id: str, *, timeout: float = 30.0) -> None:
        super().delete(checkpoint_id, timeout=timeout)
        with self._mutex:
            self._ranges.pop(checkpoint_id, None)
        self._forget_used()


class FastTxn:
    """One save into the fast tier: room reserved at save() (:meth:`reserve`), regions carved
    from it by the copier (:meth:`take`), the manifest published by :meth:`commit`."""

    def __init__(self, tier: FastTier, lock: BackendLock) -> None:
        import secrets

        self.tier = tier
        self.token = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._lock: BackendLock | None = lock
        self.state = "open"
        self.extents: list[_Extent] = []
        self.held: list[tuple[int, int, int]] = []  # (slab, lo, hi) of reused chunks
        self._reused: set[str] = set()
        # the slab ranges the manifest to commit names, when its capture worked them out
        # (from where it placed each chunk, in array operations); else parsed from the manifest
        self.placed_ranges: dict[int, list[tuple[int, int]]] | None = None
        self.map_s = 0.0  # seconds spent creating and mapping slabs (take)
        self._memory: dict[int, torch.Tensor] = {}  # slab -> its mapped memory, as take() met it
        with tier._alloc:
            tier._fast_txns.add(self)

    def __enter__(self) -> FastTxn:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.state == "open":
            self.abort()

    def reserve(self, nbytes: int, piece: int) -> bool:
        """Room for ``nbytes`` (in copies of at most ``piece`` bytes), or False: the tier is full."""
        return self.tier._reserve(self, nbytes, piece)

    def take(self, n: int) -> tuple[int, int, torch.Tensor] | None:
        """The next ``n`` reserved bytes: ``(slab, offset, host tensor)``, or None when the
        reservation is used up. Maps (and on first use creates) the slab."""
        for e in self.extents:
            start = -(-e.cursor // ALIGN) * ALIGN
            if start + n <= e.hi:
                e.cursor = start + n
                memory = self._memory.get(e.slab)
                if memory is None:  # (once per slab and save: a piece is taken per copy)
                    started = time.perf_counter()
                    memory = self._memory[e.slab] = self.tier._slab_memory(e.slab)
                    self.map_s += time.perf_counter() - started
                return e.slab, start, memory[start : start + n]
        return None

    def give_back(self, slab: int, offset: int, n: int) -> None:
        """Return the last region taken from its extent (a failed copy); others wait for the end."""
        for e in self.extents:
            if e.slab == slab and e.cursor == offset + n:
                e.cursor = offset
                return

    def reuse(self, chunks: dict[int, str]) -> dict[int, str]:
        """Of ``chunks`` (index -> fast name), those still stored, held until commit or abort."""
        if self.state != "open":
            raise CheckpointError(f"write transaction is {self.state}")
        out: dict[int, str] = {}
        with self.tier._alloc:
            for k, name in chunks.items():
                if name in self._reused or self.tier._named(name):
                    _h, slab, off, n = chunk_location(name)
                    self.held.append((slab, off, off + n))
                    self._reused.add(name)
                    out[k] = name
        return out

    def commit(self, manifest: Manifest) -> None:
        """Publish ``manifest`` (its chunks' bytes are in the slabs already); its ranges become used."""
        tier, backend = self.tier, self.tier.backend
        if self.state != "open":
            raise CheckpointError(f"write transaction is {self.state}")
        self.state = "committing"
        try:
            if not ID_RE.match(manifest.id):
                raise CheckpointError(f"checkpoint id {manifest.id!r} is not a safe file name")
            with tier._commit_lock:
                tier._confirm_lease("confirming the writer lease")
                if manifest.tag is not None:
                    owner = tier.tag_owner(manifest.tag, other_than=manifest.id)
                    if owner is not None:
                        raise CheckpointError(
                            f"tag {manifest.tag!r} already names checkpoint {owner} in {tier.root}; a tag names "
                            f"one checkpoint: {manifest.id} was not committed"
                        )
                final = f"{MANIFESTS}/{manifest.id}.json"
                tmp = f"{TMP}/{self.token}-{manifest.id}.json"
                with tier._io("writing manifest", tmp, writing=True):
                    handle = backend.open_write(tmp)
                    try:
                        handle.write(manifest.to_json(tier._trees))
                    finally:
                        handle.close(sync=tier.config.fsync)
                with tier._io("publishing manifest", final, writing=True):
                    backend.rename(tmp, final)
                ranges = tier._ranges_of(manifest, self.placed_ranges)  # (outside the lock: parsing takes a while)
                with tier._alloc:
                    tier._manifest_cache[f"{manifest.id}.json"] = manifest
                    tier._used_generation += 1  # (a rebuild listing from before the rename scans again)
                    if tier._used is not None:
                        used = dict(tier._used)
                        for slab, more in ranges.items():
                            used[slab] = _merge(used.get(slab, []) + more)
                        tier._used = used
        except BaseException:
            self.abort()
            raise
        self.state = "committed"
        self._release()

    def abort(self) -> None:
        """Give the reserved room back and drop temporary files. Idempotent."""
        if self.state in ("aborted", "committed"):
            return
        self.state = "aborted"
        try:
            for name in self.tier.backend.listdir(TMP):
                if name.startswith(f"{self.token}-"):
                    self.tier.backend.remove(f"{TMP}/{name}")
        except OSError:
            pass
        self._release()

    def _release(self) -> None:
        tier = self.tier
        with tier._alloc:
            registered = self in tier._fast_txns
            tier._fast_txns.discard(self)
            self.extents, self.held = [], []
            self._memory = {}
            tier._alloc.notify_all()
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()
        if registered:
            tier._lease.drop()


def _add_ranges(used: dict[int, builtins.list[tuple[int, int]]], manifest: Manifest) -> None:
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


def _merge(ranges: builtins.list[tuple[int, int]]) -> builtins.list[tuple[int, int]]:
    out: builtins.list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out

