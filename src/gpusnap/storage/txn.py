"""A write transaction: one checkpoint's chunks go into temporary packs; ``commit`` publishes.

States: ``open -> committing -> committed``, or ``-> aborted``. A backend failure while
``open`` marks it *failed* (further puts and the commit raise a :class:`StorageError`) and
``abort()`` (or leaving the ``with`` block) cleans up; ``commit()`` either commits or aborts.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING

from gpusnap.errors import CheckpointError, StorageError
from gpusnap.storage.backend import BackendLock
from gpusnap.storage.chunk_names import is_device_name
from gpusnap.storage.layout import ID_RE, INTACT, MANIFESTS, PACKS, TMP, byte_view, storage_error
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.pack import PackIndex, PackWriter, pack_path

if TYPE_CHECKING:
    from gpusnap.storage.repository import Repository

__all__ = ["WriteTxn", "publish_packs"]


class WriteTxn:
    """One checkpoint being written: chunks go into temporary packs, :meth:`commit` publishes.

    Holds the writer lease and the shared root lock from :meth:`Repository.begin_write` until
    commit or abort. Every chunk it stores, or reuses because it is already stored
    (:meth:`has_chunk`, :meth:`put_chunk`, :meth:`reuse`), is pinned until then: a gc of the
    same Repository (a Checkpointer's retention after the previous commit) keeps its pack,
    and keeps this transaction's ``tmp/`` files.

    States: ``open -> committing -> committed``, or ``-> aborted`` from any but committed.
    Up to ``config.io_threads`` pack writers are open at once, each used by one thread at a
    time, so concurrent ``put_chunk`` calls write different files in parallel.
    """

    def __init__(self, repo: Repository, lock: BackendLock) -> None:
        self._repo = repo
        self._backend = repo.backend
        self._config = repo.config
        self._lock: BackendLock | None = lock
        self.token = f"{os.getpid()}-{secrets.token_hex(4)}"  # names its tmp/ files
        self._cond = threading.Condition()
        self._state = "open"
        self._error: StorageError | None = None  # first backend failure; the txn cannot commit
        self._put: set[str] = set()  # digests written or being written by this txn
        self._free: list[PackWriter] = []  # open writers no thread is using
        self._last: dict[int, PackWriter] = {}  # thread -> writer it used last (locality)
        self._writers: list[PackWriter] = []  # every writer made, for cleanup
        self._finished: list[PackIndex] = []  # full packs, trailer written, still in tmp/
        self._live = 0  # unfinished writers (free or in use), at most config.io_threads
        self._busy = 0  # put_chunk calls holding a writer
        self._seq = 0
        self._device_names = False  # (allow_device_names)
        repo.txn_opened(self)  # gc keeps what it pins (stored or reused) and its tmp/ files

    def __enter__(self) -> WriteTxn:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._state in ("open", "committing"):
            self.abort()

    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._state != "open":
            raise CheckpointError(f"write transaction is {self._state}")

    def _take_free_writer(self) -> PackWriter | None:
        """A free writer, preferably the one this thread used last: a thread storing a span's
        chunks in order then writes them back to back, which restores read in one call."""
        if not self._free:
            return None
        mine = self._last.get(threading.get_ident())
        if mine is not None and mine in self._free:
            self._free.remove(mine)
            return mine
        return self._free.pop()

    def has_chunk(self, digest: str) -> bool:
        """Whether ``digest`` is already stored (committed packs) or was put in this txn; a
        stored one is pinned: the caller may now name it in the manifest without storing it."""
        with self._cond:
            if digest in self._put:
                return True
        return self._repo.pin_if_stored(self, digest)

    def reuse(self, chunks: dict[int, str]) -> dict[int, str]:
        """The entries of ``chunks`` (index -> digest, e.g. chunks unchanged since the previous
        checkpoint) whose digest is stored, each pinned until commit or abort. The caller stores
        the others itself: a retention run may have deleted them since it learned of them."""
        with self._cond:
            self._check_usable()
            put = set(self._put)
        return {k: d for k, d in chunks.items() if d in put or self._repo.pin_if_stored(self, d)}

    def allow_device_names(self) -> None:
        """This transaction stores the program's own state by device hash (a promotion):
        ``nh:...`` names are accepted from now on (storage/chunk_names.py)."""
        self._device_names = True

    def put_chunk(self, digest: str, data: bytes | bytearray | memoryview) -> bool:
        """Store one chunk unless known; returns False when deduplicated. Thread-safe.

        ``digest`` is trusted to be ``chunk_digest(data)`` (the capture layer computed it from
        the same bytes); :meth:`Repository.verify` would expose a mismatch. A name of the
        device-hash space (``nh:...``) is refused unless :meth:`allow_device_names` was
        called: bytes from outside the program never take one. After a :class:`StorageError`
        the transaction can only be aborted.
        """
        view = byte_view(data)
        return self.put_run([digest], view, [len(view)]) == 1

    def put_run(self, digests: list[str], data: bytes | bytearray | memoryview, lengths: list[int]) -> int:
        """Store chunks that lie back to back in ``data`` (``lengths`` bytes each), those not
        known yet; returns how many were written. Thread-safe; as :meth:`put_chunk` otherwise.

        Each stretch of new chunks goes to the pack with one write (a promotion's 64 MiB run:
        one write instead of sixteen), and they lie back to back in the pack as in ``data``.
        """
        for digest in digests:
            if is_device_name(digest) and not self._device_names:
                raise ValueError(f"chunk name {digest!r}: device-hash names are a promotion's alone "
                                 "(storage/chunk_names.py)")
        view = byte_view(data)
        if len(digests) != len(lengths) or sum(lengths) != len(view):
            raise ValueError(f"a run of {len(digests)} chunk(s), {sum(lengths)} bytes, does not fill {len(view)} bytes")
        with self._cond:
            while True:
                self._check_usable()
                new = [d not in self._put and not self._repo.pin_if_stored(self, d) for d in digests]
                if not any(new):
                    return 0
                if self._free or self._live < self._config.io_threads:
                    break
                self._cond.wait()
            mine: list[str] = []
            for i, d in enumerate(digests):
                if not new[i] or d in self._put:  # (twice in one run: the first one stores it)
                    new[i] = False
                    continue
                mine.append(d)
                self._put.add(d)
                self._repo.pin(self, d)  # kept by gc from its temporary pack to the commit
            self._busy += 1
            writer = self._take_free_writer()
            if writer is None:
                self._live += 1
                self._seq += 1
            path = writer.tmp_path if writer is not None else f"{TMP}/{self.token}-{self._seq:04d}.pack"
        index: PackIndex | None = None
        try:
            if writer is None:
                writer = PackWriter(self._backend, path, fsync=self._config.fsync, direct=self._config.direct_writes == "auto")
                with self._cond:
                    self._writers.append(writer)
            for first, stop in _stretches(new):
                at = sum(lengths[:first])
                size = sum(lengths[first:stop])
                writer.append_run(digests[first:stop], view[at : at + size], lengths[first:stop])
            if writer.nbytes >= self._config.pack_size:
                index = writer.finish()  # fsync here spreads sync cost over the save
        except BaseException as exc:
            error = self._fail(writer, mine, exc, path)
            if error is None:
                raise
            raise error from exc
        with self._cond:
            if index is not None:
                self._finished.append(index)
                self._live -= 1
                self._last.pop(threading.get_ident(), None)
            else:
                self._free.append(writer)
                self._last[threading.get_ident()] = writer
            self._busy -= 1
            self._cond.notify_all()
        return len(mine)

    def _fail(self, writer: PackWriter | None, digests: list[str], exc: BaseException, path: str) -> StorageError | None:
        """Mark the txn failed and drop the broken writer's file; the rest waits for abort()."""
        if writer is not None:
            writer.discard()
        error = None
        if isinstance(exc, OSError):
            error = storage_error(exc, "writing pack", self._backend.describe(path), writing=True)
        with self._cond:
            self._put.difference_update(digests)
            self._live -= 1
            self._busy -= 1
            if self._error is None:
                self._error = error or StorageError(f"writing pack {path} failed: {exc!r}; {INTACT}")
            self._cond.notify_all()
        return error

    def commit(self, manifest: Manifest) -> None:
        """Publish ``manifest``: finish and sync packs, rename them, then the manifest. Releases the lock.

        On any failure the transaction is aborted (temporary files removed) before raising;
        packs already renamed into ``packs/`` stay for gc (another writer may already use them).
        """
        problem: CheckpointError | None = None
        with self._cond:
            while self._busy:
                self._cond.wait()
            try:
                self._check_usable()
            except CheckpointError as exc:
                problem = exc
            else:
                self._state = "committing"
        if problem is not None:
            self.abort()  # a failed put left temporary files; a closed txn makes this a no-op
            raise problem
        try:
            with self._repo.commit_lock:  # the tag check and the manifest's rename: one step
                self._commit(manifest)
        except BaseException:
            self.abort()
            raise
        with self._cond:
            self._state = "committed"
        self._release()

    def _commit(self, manifest: Manifest) -> None:
        repo, backend, fsync = self._repo, self._backend, self._config.fsync
        if not ID_RE.match(manifest.id):
            raise CheckpointError(f"checkpoint id {manifest.id!r} is not a safe file name")
        missing = [d for s in manifest.storages for d in s.chunks if d not in self._put and not repo.is_stored(d)]
        if missing:
            raise CheckpointError(
                f"manifest {manifest.id} names {len(missing)} chunk(s) never stored, e.g. {missing[0]}; "
                "nothing was committed"
            )
        repo.confirm_lease("confirming the writer lease")  # an object store's can be lost
        repo.refuse_taken_tag(manifest)
        final = f"{MANIFESTS}/{manifest.id}.json"
        with repo.io_errors("checking", final, writing=True):
            if backend.exists(final):
                raise CheckpointError(f"checkpoint {manifest.id} already exists in {repo.root}")
        data = manifest.to_json()

        packs = list(self._finished)
        for writer in self._free:
            with repo.io_errors("writing pack", writer.tmp_path, writing=True):
                packs.append(writer.finish())
        self._free = []
        publish_packs(repo, packs, lambda doing, path: repo.io_errors(doing, path, writing=True))

        tmp = f"{TMP}/{self.token}-{manifest.id}.json"
        with repo.io_errors("writing manifest", tmp, writing=True):
            handle = backend.open_write(tmp)
            try:
                handle.write(data)
            finally:
                handle.close(sync=fsync)
        with repo.io_errors("publishing manifest", final, writing=True):
            backend.rename(tmp, final)
        if fsync:
            try:
                backend.sync_dir(MANIFESTS)
            except OSError as exc:
                # not durable, so not committed: take it back, so that the error and list() agree
                try:
                    backend.remove(final)
                except OSError:
                    pass
                raise storage_error(exc, "syncing", backend.describe(MANIFESTS), writing=True) from exc
        repo.remember_committed(manifest)

    def abort(self) -> None:
        """Drop everything this transaction wrote to ``tmp/`` and release the lock. Idempotent."""
        with self._cond:
            if self._state in ("aborted", "committed"):
                return
            self._state = "aborted"
            self._cond.notify_all()
            while self._busy:
                self._cond.wait()
            writers, self._writers, self._free, self._finished = self._writers, [], [], []
        for writer in writers:
            writer.discard()  # best effort; a file already renamed into packs/ is simply gone
        try:
            leftovers = [n for n in self._backend.listdir(TMP) if n.startswith(f"{self.token}-")]
        except OSError:
            leftovers = []
        for name in leftovers:
            try:
                self._backend.remove(f"{TMP}/{name}")
            except OSError:
                pass
        self._release()

    def _release(self) -> None:
        """Unpin (after a commit, its manifest is cached: gc sees it) and let the locks go."""
        registered = self._repo.txn_closed(self)
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()
        if registered:
            self._repo.drop_lease_hold()


def publish_packs(
    repo: Repository, packs: list[PackIndex], io: Callable[[str, str], AbstractContextManager[None]]
) -> list[PackIndex]:
    """Rename finished temporary packs into ``packs/`` under their content names, sync the
    directories (``config.fsync``), then make them known to ``repo``; returns their indexes
    at the final paths. ``io(doing, path)`` turns a backend failure into the caller's error."""
    backend = repo.backend
    fans = sorted({pack_path(p.pack_id).rsplit("/", 1)[0] for p in packs})
    for fan in fans:
        with io("creating", fan):
            backend.makedirs(fan)
    published: list[PackIndex] = []
    for index in packs:
        dst = pack_path(index.pack_id)
        with io("publishing pack", dst):
            backend.rename(index.path, dst)
        published.append(PackIndex(dst, index.pack_id, index.size, index.entries))
    if repo.config.fsync and fans:
        for d in [*fans, PACKS]:
            with io("syncing", d):
                backend.sync_dir(d)
    for index in published:
        repo.add_pack(index)
    return published


def _stretches(new: list[bool]) -> list[tuple[int, int]]:
    """``(first, stop)`` of each maximal stretch of True in ``new``."""
    out: list[tuple[int, int]] = []
    for i, is_new in enumerate(new):
        if not is_new:
            continue
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out
