"""A fast tier's slab files: listing, creating and mapping them (page-locked), and preparing
them ahead of the saves that will need them (``storage.slab_prep``).

:class:`SlabFiles` is a part of :class:`~gpusnap.storage.fast_tier.FastTier` (a base class
it builds on, one idea per file). The writer maps each slab once and keeps the map for its
life; :meth:`make_slab` is where a slab file is made.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import threading
from typing import Any

import torch

from gpusnap.config import Config
from gpusnap.errors import StorageError
from gpusnap.host_map import MappedMemory, in_steps
from gpusnap.storage.backend_protocol import Backend
from gpusnap.storage.layout import storage_error
from gpusnap.storage.private_dir import open_private
from gpusnap.storage.slab_layout import SLAB_ROUND, SLABS, slab_path
from gpusnap.storage import slab_prep
from gpusnap.storage.slab_prep import SlabPreparer

__all__ = ["SlabFiles"]


class SlabFiles:
    """The slab files of one fast root and this process's maps of them."""

    backend: Backend
    config: Config
    root: str
    pinned: bool
    register_errors: builtins.list[str]
    _mutex: threading.RLock
    _alloc: threading.Condition
    _slab_sizes: dict[int, int]
    _maps: dict[int, Any]
    _map_lock: threading.Lock
    _preparing: dict[int, threading.Event]
    _closed: bool
    _preparer: SlabPreparer
    _wanted: builtins.list[int]
    _identity: tuple[int, int] | None

    def slab_files(self) -> dict[int, int]:
        """The slab files there now: slab -> bytes (a fresh listing)."""
        sizes: dict[int, int] = {}
        for name in self.listdir(SLABS) if self.backend.exists(SLABS) else []:
            if name.endswith(".slab") and name[:-5].isdigit():
                sizes[int(name[:-5])] = self.backend.size(f"{SLABS}/{name}")
        return sizes


    def prepare_errors(self) -> builtins.list[str]:
        """Why slabs made ahead of use failed (``"slab N: cause"``), oldest first."""
        return builtins.list(self._preparer.errors)

    def slab_memory(self, slab: int) -> torch.Tensor:
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
            self._preparer.hurry()  # (the slab in hand may be the preparer's: no rests now)
            busy.wait()
        try:
            if self._root_identity() != self._identity:  # (never map another tier's file as ours)
                raise StorageError(
                    f"the fast tier {self.root} was removed: slab {slab} of the tier this process opened is gone "
                    "(its checkpoints with it)"
                )
            mapped = self.make_slab(slab)
            with self._map_lock:
                if not self._closed:  # (closed meanwhile: the caller's tensor keeps it while used)
                    self._maps[slab] = mapped
            self._preparer.made(slab)  # (by whoever: an earlier failure of it is over)
            return mapped.tensor
        finally:
            with self._map_lock:
                self._preparing.pop(slab, None)
            busy.set()

    def make_slab(self, slab: int) -> Any:
        """Create slab ``slab``'s file (every page allocated) and map it, page-locked where
        CUDA is available; a ``MappedMemory``. The one place slab files are made: a test
        replaces it to inject faults (a full file system, a slow tmpfs)."""

        with self._mutex:
            size = self._slab_sizes[slab]
        # made in steps, with rests between them when it is the background preparer's
        rest = self._preparer.rest if self._preparer.on_own_thread() else None
        path = self.backend.local_path(slab_path(slab))  # type: ignore[attr-defined]
        with self.io_errors("creating slab", slab_path(slab), writing=True):
            fd = open_private(path, os.O_RDWR | os.O_CREAT)  # (never a planted link, nor another user's file)
            try:
                had = os.fstat(fd).st_size
                if had < size:
                    # allocates every page now: a full tmpfs is ENOSPC here, not SIGBUS at a copy
                    try:
                        in_steps(size, slab_prep.STEP_BYTES, lambda lo, n: os.posix_fallocate(fd, lo, n), rest)
                    except BaseException:  # (the steps made give their memory back, as one call would)
                        with contextlib.suppress(OSError):
                            os.ftruncate(fd, had)
                        raise
            except BaseException:
                os.close(fd)
                raise
        try:
            try:
                return MappedMemory(fd, size, pinned=self.pinned, step=slab_prep.STEP_BYTES, between=rest)
            except RuntimeError as exc:  # page-locking refused: copies go through pageable memory
                self.register_errors.append(f"slab {slab}: {exc}")
                return MappedMemory(open_private(path, os.O_RDWR), size, pinned=False)
        except OSError as exc:
            raise storage_error(exc, "mapping slab", self.backend.describe(slab_path(slab)), writing=True) from exc

    def prepare_for(self, saves: int, need: int, piece: int) -> int:
        """:meth:`prepare_ahead` for ``saves`` saves of ``need`` bytes copied in pieces of at
        most ``piece`` bytes (:meth:`per_save`, as :meth:`reserve` counts it)."""
        return self.prepare_ahead(saves * self.per_save(need, piece))

    def slab_bytes(self) -> int:
        """Bytes of the slab files this tier holds (its host memory, on a tmpfs)."""
        with self._mutex:
            if not self._slab_sizes:
                self._slab_sizes = self.slab_files()
            return sum(self._slab_sizes.values())

    def prepare_ahead(self, nbytes: int) -> int:
        """Have slabs of ``nbytes`` in all (within :meth:`capacity`), and prepare every slab
        not mapped yet on a background thread, lowest first: the saves that follow find their
        memory created, mapped and page-locked. Returns the bytes of slabs it set aside.

        Creating and page-locking costs the program ~70 ms of training per GiB whenever it
        is done (the kernel populating tmpfs pages); done ahead, no save waits for it."""
        with self._alloc:
            if not self._slab_sizes:
                self._slab_sizes = self.slab_files()
            total = sum(self._slab_sizes.values())
            added = 0
            while total < nbytes:
                size = min(self.config.fast_slab_bytes, -(-(nbytes - total) // SLAB_ROUND) * SLAB_ROUND)
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
        """Wait for the slabs set aside to be made, the preparer resting no more meanwhile; a
        StorageError lists those that failed (a save that needs one makes it itself, and fails
        with the cause if it recurs)."""
        self._preparer.join(timeout, hurry=True)
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

    def _slab_bytes(self, slab: int, lo: int, hi: int) -> memoryview:
        with self._mutex:
            if slab not in self._slab_sizes:  # (a slab another writer made)
                self._slab_sizes.update(self.slab_files())
        return memoryview(self.slab_memory(slab)[lo:hi].numpy()).cast("B")
