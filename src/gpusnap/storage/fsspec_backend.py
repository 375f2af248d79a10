"""A :class:`~gpusnap.storage.backend.Backend` over any fsspec filesystem (S3, GCS, memory...).

Limits worth knowing before pointing a checkpoint root at an object store:

* **No cross-process lock.** The root lock is an in-process reader/writer lock keyed by the
  root URL: two :class:`~gpusnap.storage.repository.Repository` objects in one process
  exclude each other, two processes do not. Run ``gc`` only when no other process writes
  to the same root.
* ``rename`` is ``fs.mv``: on object stores a copy then a delete, not atomic. Commit still
  holds, because a reader sees a manifest only once its object exists in full.
* ``sync_dir`` and ``close(sync=True)`` have nothing to do: an object is durable once its
  upload completes on ``close``.
* ``readinto_range`` reads into a temporary ``bytes`` and copies once: remote stores hand
  back bytes anyway, and some filesystems (fsspec's memory one) share a single file
  position between concurrent opens, which ``cat_file`` avoids.
"""

from __future__ import annotations

import posixpath
import threading
import time
from typing import Any

from gpusnap.storage.backend import BackendLock, WriteHandle

__all__ = ["FsspecBackend"]


class _RWLock:
    """Many shared holders or one exclusive holder, with timeouts."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False

    def acquire(self, exclusive: bool, timeout: float) -> bool:
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while self._exclusive or (exclusive and self._shared):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            if exclusive:
                self._exclusive = True
            else:
                self._shared += 1
            return True

    def release(self, exclusive: bool) -> None:
        with self._cond:
            if exclusive:
                self._exclusive = False
            else:
                self._shared -= 1
            self._cond.notify_all()


_LOCKS: dict[str, _RWLock] = {}
_LOCKS_GUARD = threading.Lock()


def _rwlock_for(key: str) -> _RWLock:
    with _LOCKS_GUARD:
        lock = _LOCKS.get(key)
        if lock is None:
            lock = _LOCKS[key] = _RWLock()
        return lock


class _HeldLock:
    def __init__(self, lock: _RWLock, exclusive: bool) -> None:
        self._lock: _RWLock | None = lock
        self._exclusive = exclusive

    def release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release(self._exclusive)


class _FsspecWriteHandle:
    def __init__(self, f: Any) -> None:
        self._f = f

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while len(view):
            written = self._f.write(view)
            if written is None:  # some fsspec files do not report a count but write it all
                return
            view = view[written:]

    def close(self, *, sync: bool) -> None:
        self._f.close()


class FsspecBackend:
    """Paths under ``url`` on the fsspec filesystem it names (``memory://x``, ``s3://b/p``...)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        import fsspec  # imported here so that local-only use does not need fsspec

        self.fs, base = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self._base: str = base.rstrip("/") or "/"
        self.root: str = str(self.fs.unstrip_protocol(self._base))

    def __repr__(self) -> str:
        return f"FsspecBackend({self.root!r})"

    def _abs(self, path: str) -> str:
        return posixpath.join(self._base, path) if path else self._base

    def describe(self, path: str) -> str:
        return str(self.fs.unstrip_protocol(self._abs(path)))

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(self._abs(path)))

    def isdir(self, path: str) -> bool:
        return bool(self.fs.isdir(self._abs(path)))

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(self._abs(path), exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        full = self._abs(path).rstrip("/")
        names = []
        for entry in self.fs.ls(full, detail=False):
            entry = entry.rstrip("/")
            if entry == full:  # some filesystems list a file as itself
                continue
            names.append(entry.rsplit("/", 1)[-1])
        return sorted(names)

    def size(self, path: str) -> int:
        return int(self.fs.size(self._abs(path)))

    def open_write(self, path: str) -> WriteHandle:
        return _FsspecWriteHandle(self.fs.open(self._abs(path), "wb"))

    def rename(self, src: str, dst: str) -> None:
        self.fs.mv(self._abs(src), self._abs(dst))

    def read_range(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        end = None if length is None else offset + length
        return bytes(self.fs.cat_file(self._abs(path), start=offset, end=end))

    def readinto_range(self, path: str, offset: int, out: memoryview) -> int:
        view = memoryview(out).cast("B") if memoryview(out).format != "B" else memoryview(out)
        data = self.read_range(path, offset, len(view))
        view[: len(data)] = data
        return len(data)

    def remove(self, path: str) -> None:
        try:
            self.fs.rm_file(self._abs(path))
        except FileNotFoundError:
            pass

    def sync_dir(self, path: str) -> None:
        return None

    def lock(self, *, exclusive: bool, timeout: float) -> BackendLock:
        lock = _rwlock_for(self.root)
        if not lock.acquire(exclusive, timeout):
            raise TimeoutError(f"lock busy: {self.root}")
        return _HeldLock(lock, exclusive)
