"""Storage test support: a fault-injecting backend and small builders.

:class:`FaultyBackend` wraps any backend and fails the way real media do (full disk after N
bytes, permission denied on reads, a failing rename), always through the Backend interface,
so the repository's error handling is exercised exactly as in production.
"""

from __future__ import annotations

import errno
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpusnap.config import Config
from gpusnap.kernels.hashing import chunk_digest
from gpusnap.storage.backend import Backend, BackendLock, WriteHandle
from gpusnap.storage.lease import WriterLease
from gpusnap.storage.manifest import Manifest, StorageEntry
from gpusnap.storage.repository import Repository

__all__ = [
    "CHUNK",
    "HANG_S",
    "FaultyBackend",
    "any_root",
    "chunks_of",
    "commit_checkpoint",
    "small_config",
    "tmp_files",
    "wait_until",
]

CHUNK = 512  # the smallest chunk size Config accepts: keeps every test fast


def _oserror(code: int, path: str) -> OSError:
    return OSError(code, os.strerror(code), path)


class _FaultyHandle:
    def __init__(self, owner: FaultyBackend, inner: WriteHandle, path: str) -> None:
        self._owner = owner
        self._inner = inner
        self._path = path

    def write(self, data: bytes | memoryview) -> None:
        if self._owner.before_write is not None:
            self._owner.before_write(self._path)
        view = memoryview(data)
        budget = self._owner.write_budget
        if budget is not None and self._owner.bytes_written + len(view) > budget:
            fits = max(0, budget - self._owner.bytes_written)
            self._inner.write(view[:fits])  # a real full disk accepts what fits, then fails
            self._owner.bytes_written += fits
            raise _oserror(self._owner.write_errno, self._path)
        self._inner.write(view)
        self._owner.bytes_written += len(view)

    def close(self, *, sync: bool) -> None:
        self._inner.close(sync=sync)


class FaultyBackend:
    """Delegates to ``inner``; the public attributes arm faults and may change mid-test.

    * ``write_budget``: total bytes writes may add before ``write_errno`` (ENOSPC) is raised.
    * ``fail_open_write``: paths for which ``open_write`` raises ``write_errno``.
    * ``read_errno``: raised by every ``read_range`` / ``readinto_range`` / ``size`` when set.
    * ``fail_rename``: destination paths for which ``rename`` raises ``rename_errno`` (EIO).
    * ``before_write`` / ``before_rename``: called with the path (the destination) before
      each write or rename: a test blocks there (a slow disk) or raises (Ctrl-C mid-save).
    * ``reads``: the paths read, in order (``read_range`` and ``readinto_range``).
    """

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.root = inner.root
        self.bytes_written = 0
        self.write_budget: int | None = None
        self.write_errno = errno.ENOSPC
        self.fail_open_write: Callable[[str], bool] | None = None
        self.read_errno: int | None = None
        self.fail_rename: Callable[[str], bool] | None = None
        self.rename_errno = errno.EIO
        self.before_write: Callable[[str], None] | None = None
        self.before_rename: Callable[[str], None] | None = None
        self.reads: list[str] = []

    def describe(self, path: str) -> str:
        return self.inner.describe(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def isdir(self, path: str) -> bool:
        return self.inner.isdir(path)

    def makedirs(self, path: str) -> None:
        self.inner.makedirs(path)

    def listdir(self, path: str) -> list[str]:
        return self.inner.listdir(path)

    def size(self, path: str) -> int:
        self._maybe_fail_read(path)
        return self.inner.size(path)

    def open_write(self, path: str) -> WriteHandle:
        if self.fail_open_write is not None and self.fail_open_write(path):
            raise _oserror(self.write_errno, self.describe(path))
        return _FaultyHandle(self, self.inner.open_write(path), self.describe(path))

    def rename(self, src: str, dst: str) -> None:
        if self.before_rename is not None:
            self.before_rename(dst)
        if self.fail_rename is not None and self.fail_rename(dst):
            raise _oserror(self.rename_errno, self.describe(dst))
        self.inner.rename(src, dst)

    def read_range(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        self._maybe_fail_read(path)
        self.reads.append(path)
        return self.inner.read_range(path, offset, length)

    def readinto_range(self, path: str, offset: int, out: memoryview) -> int:
        self._maybe_fail_read(path)
        self.reads.append(path)
        return self.inner.readinto_range(path, offset, out)

    def remove(self, path: str) -> None:
        self.inner.remove(path)

    def sync_dir(self, path: str) -> None:
        self.inner.sync_dir(path)

    def lock(self, *, exclusive: bool, timeout: float) -> BackendLock:
        return self.inner.lock(exclusive=exclusive, timeout=timeout)

    def writer_lease(self, owner: dict[str, Any], timeout: float) -> WriterLease:
        return self.inner.writer_lease(owner, timeout)

    def _maybe_fail_read(self, path: str) -> None:
        if self.read_errno is not None:
            raise _oserror(self.read_errno, self.describe(path))


def small_config(**overrides: object) -> Config:
    """Tiny chunks and packs so a handful of chunks spans several packs."""
    values: dict[str, object] = dict(chunk_size=CHUNK, pack_size=4 * CHUNK, io_threads=2, staging_bytes=8 * CHUNK)
    values.update(overrides)
    return Config(**values)  # type: ignore[arg-type]


def chunks_of(seed: int, n: int, size: int = CHUNK) -> list[bytes]:
    """``n`` distinct deterministic chunks; different seeds never share a chunk."""
    out = []
    for i in range(n):
        head = seed.to_bytes(4, "little") + i.to_bytes(4, "little")
        out.append(head + bytes((seed * 31 + i * 7 + j) % 251 for j in range(size - len(head))))
    return out


def commit_checkpoint(
    repo: Repository,
    chunk_lists: Sequence[Sequence[bytes]],
    *,
    tag: str | None = None,
    created: float | None = None,
    stats: dict[str, Any] | None = None,
    checkpoint_id: str | None = None,
) -> Manifest:
    """Store one storage per list of chunks and commit a manifest naming them (under
    ``checkpoint_id``, else a new id)."""
    created = time.time() if created is None else created
    with repo.begin_write() as txn:
        storages = []
        for chunks in chunk_lists:
            digests = []
            for data in chunks:
                digest = chunk_digest(data)
                txn.put_chunk(digest, data)
                digests.append(digest)
            storages.append(StorageEntry(sum(len(c) for c in chunks), "cpu", tuple(digests)))
        manifest = Manifest(
            id=checkpoint_id or repo.new_id(created),
            tag=tag,
            created=created,
            chunk_size=CHUNK,
            storages=tuple(storages),
            tree={"t": "dict", "items": []},
            stats=stats if stats is not None else {"bytes_total": sum(s.nbytes for s in storages)},
        )
        txn.commit(manifest)
    return manifest


def tmp_files(root: Path) -> list[str]:
    """What a local root's ``tmp/`` holds (should be empty between transactions)."""
    return sorted(os.listdir(root / "tmp"))


@contextmanager
def any_root(kind: str, tmp_path: Path) -> Iterator[str]:
    """A fresh root: ``"local"`` (a path under ``tmp_path``) or ``"memory"`` (a unique memory:// URL)."""
    if kind == "local":
        yield str(tmp_path / "ckpt")
        return
    import fsspec

    name = f"gpusnap-test-{uuid.uuid4().hex}"
    try:
        yield f"memory://{name}"
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists(f"/{name}"):
            fs.rm(f"/{name}", recursive=True)


HANG_S = 120.0  # a wait that ends only on a hang: the test then fails instead of blocking the suite


def wait_until(ready: Callable[[], object], what: str, timeout: float = HANG_S) -> None:
    """Poll ``ready`` until it is true; AssertionError naming ``what`` after ``timeout`` (a hang
    guard: the condition must come true however slowly the machine runs, never by a deadline)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout:.0f} s")
        time.sleep(0.005)
