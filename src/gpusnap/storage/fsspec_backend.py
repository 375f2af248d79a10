"""A :class:`~gpusnap.storage.backend.Backend` over any fsspec filesystem (S3, GCS, memory...).

Limits worth knowing before pointing a checkpoint root at an object store:

* **No cross-process lock.** The root lock is an in-process reader/writer lock keyed by the
  root URL: two :class:`~gpusnap.storage.repository.Repository` objects in one process
  exclude each other, two processes do not.
* **The writer lease is a lease object, not a lock.** ``ROOT/writer`` names its owner (pid,
  host, a random token) and when it was last renewed (at every commit). A writer is refused
  while it names another owner that still looks alive: a process of this host that exists,
  or any owner renewed within :data:`LEASE_TTL_S`. Object stores have no compare-and-swap
  through fsspec, so two writers starting at the same moment can both believe they won; the
  one whose token was overwritten finds out at its next commit (or gc), which it refuses
  with a :class:`~gpusnap.StorageError` before publishing anything. A writer idle for
  longer than the TTL can be taken over by a writer on another host; it too finds out at
  its next commit. A crashed writer on another host blocks new writers for up to the TTL
  (or delete ``ROOT/writer`` once you know it is gone).
* ``rename`` is ``fs.mv``: on object stores a copy then a delete, not atomic. Commit still
  holds, because a reader sees a manifest only once its object exists in full.
* ``sync_dir`` and ``close(sync=True)`` have nothing to do: an object is durable once its
  upload completes on ``close``.
* ``readinto_range`` reads into a temporary ``bytes`` and copies once: remote stores hand
  back bytes anyway, and some filesystems (fsspec's memory one) share a single file
  position between concurrent opens, which ``cat_file`` avoids.
* Errors: every failure of the filesystem surfaces as :class:`OSError` (the protocol's
  contract): an exception that is not one (botocore's ``ClientError``, aiohttp's errors)
  becomes ``OSError(EIO)`` naming the path, with the original as ``__cause__``.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gpusnap.storage.backend_protocol import BackendLock, WriteHandle, poll_until
from gpusnap.storage.lease import (
    LEASE_NAME,
    LeaseBusy,
    WriterLease,
    describe_owner,
    encode_owner,
    parse_owner,
)

__all__ = ["LEASE_TTL_S", "FsspecBackend"]

log = logging.getLogger("gpusnap")

LEASE_TTL_S = 300.0
"""A lease object renewed longer ago than this, by an owner on another host, is abandoned."""

_now = time.time  # the lease clock (tests replace it)


def _as_oserror(exc: Exception, where: str) -> OSError:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line
    err = OSError(errno.EIO, text, where)
    err.__cause__ = exc
    return err


@contextmanager
def _translated(where: str) -> Iterator[None]:
    """Let :class:`OSError` through; turn any other failure into ``OSError(EIO)``."""
    try:
        yield
    except OSError:
        raise
    except Exception as exc:
        raise _as_oserror(exc, where) from exc


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
    def __init__(self, f: Any, where: str) -> None:
        self._f = f
        self._where = where

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        with _translated(self._where):
            while len(view):
                written = self._f.write(view)
                if written is None:  # some fsspec files do not report a count but write it all
                    return
                view = view[written:]

    def close(self, *, sync: bool) -> None:
        try:
            with _translated(self._where):  # an object store uploads here
                self._f.close()
        except BaseException:
            self._drop()
            raise

    def _drop(self) -> None:
        """After a failed upload: throw the buffered file away, so that its ``__del__`` does
        not try the upload again (and fail again, unseen) when it is collected."""
        try:
            discard = getattr(self._f, "discard", None)
            if discard is not None:
                discard()  # (an object store that is gone may refuse this too)
        except Exception:
            pass
        try:
            self._f.closed = True
        except Exception:
            pass


def _alive(info: dict[str, Any]) -> bool:
    """Whether the owner a lease object names may still be writing. Another host's: renewed
    within ``LEASE_TTL_S``. This host's: a process with its pid exists and started before the
    lease was taken (a pid in use again, after a container restarted with the same hostname,
    must not keep the root unwritable for good); this process's: under a token it holds."""
    pid = info.get("pid")
    if info.get("host") == socket.gethostname() and isinstance(pid, int):
        if pid == os.getpid():
            return info.get("token") in _held_tokens
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        started, since = _process_start(pid), info.get("since")
        return started is None or not isinstance(since, (int, float)) or started <= since + 1.0
    renewed = info.get("renewed")
    return isinstance(renewed, (int, float)) and _now() - renewed < LEASE_TTL_S


def _process_start(pid: int) -> float | None:
    """When process ``pid`` started (unix time), where /proc tells (Linux), else None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


_held_tokens: set[str] = set()  # lease objects this process holds now (see _alive)


def _drop_lease_object(backend: FsspecBackend, token: str) -> None:
    _held_tokens.discard(token)
    try:
        if (backend._read_owner() or {}).get("token") == token:
            backend.remove(LEASE_NAME)
    except OSError:
        pass  # best effort: the object then goes stale (see the module docstring)


class _ObjectLease:
    """A lease object this backend wrote; see the module docstring for its limits."""

    def __init__(self, backend: FsspecBackend, owner: dict[str, Any]) -> None:
        self._backend = backend
        self._owner = dict(owner)
        _held_tokens.add(owner["token"])
        self._drop = weakref.finalize(self, _drop_lease_object, backend, owner["token"])

    def confirm(self) -> None:
        current = self._backend._read_owner()
        if current is None or current.get("token") != self._owner["token"]:
            raise OSError(
                errno.ESTALE,
                f"this writer's lease was taken over by {describe_owner(current)}",
                self._backend.describe(LEASE_NAME),
            )
        self._owner["renewed"] = _now()
        self._backend._write_owner(self._owner)

    def release(self) -> None:
        self._drop()


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

    def _fresh(self, full: str) -> None:
        """Forget what the filesystem cached about ``full`` and its parent: s3fs (and others)
        keep directory listings forever, so another process's packs, manifests and deletions
        would never be seen (a commit could deduplicate against a pack gc already deleted)."""
        invalidate = getattr(self.fs, "invalidate_cache", None)
        if invalidate is not None:
            invalidate(full)
            invalidate(posixpath.dirname(full.rstrip("/")))

    def exists(self, path: str) -> bool:
        full = self._abs(path)
        with _translated(self.describe(path)):
            self._fresh(full)
            return bool(self.fs.exists(full))

    def isdir(self, path: str) -> bool:
        full = self._abs(path)
        with _translated(self.describe(path)):
            self._fresh(full)
            return bool(self.fs.isdir(full))

    def makedirs(self, path: str) -> None:
        with _translated(self.describe(path)):
            self.fs.makedirs(self._abs(path), exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        full = self._abs(path).rstrip("/")
        names = []
        with _translated(self.describe(path)):
            self._fresh(full)
            entries = self.fs.ls(full, detail=False)
        for entry in entries:
            entry = entry.rstrip("/")
            if entry == full:  # some filesystems list a file as itself
                continue
            names.append(entry.rsplit("/", 1)[-1])
        return sorted(names)

    def size(self, path: str) -> int:
        full = self._abs(path)
        with _translated(self.describe(path)):
            self._fresh(full)
            return int(self.fs.size(full))

    def open_write(self, path: str) -> WriteHandle:
        where = self.describe(path)
        with _translated(where):
            return _FsspecWriteHandle(self.fs.open(self._abs(path), "wb"), where)

    def rename(self, src: str, dst: str) -> None:
        """A copy, then a delete (object stores have no rename). Once the copy is complete
        ``dst`` is published, so a failed delete of ``src`` must not report the rename as
        failed: the leftover is a temporary name, garbage for gc."""
        with _translated(self.describe(dst)):
            self.fs.copy(self._abs(src), self._abs(dst))
        try:
            with _translated(self.describe(src)):
                self.fs.rm_file(self._abs(src))
        except OSError as exc:
            log.warning("gpusnap: %s was published, but removing its temporary copy %s failed "
                        "(gc removes it later): %s", self.describe(dst), self.describe(src), exc)

    def read_range(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        end = None if length is None else offset + length
        with _translated(self.describe(path)):
            if not offset and end is None:  # whole: no range (S3 refuses "bytes=0-" of an empty object)
                return bytes(self.fs.cat_file(self._abs(path)))
            return bytes(self.fs.cat_file(self._abs(path), start=offset, end=end))

    def readinto_range(self, path: str, offset: int, out: memoryview) -> int:
        view = memoryview(out).cast("B") if memoryview(out).format != "B" else memoryview(out)
        data = self.read_range(path, offset, len(view))
        view[: len(data)] = data
        return len(data)

    def remove(self, path: str) -> None:
        try:
            with _translated(self.describe(path)):
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

    def _read_owner(self) -> dict[str, Any] | None:
        try:
            return parse_owner(self.read_range(LEASE_NAME))
        except FileNotFoundError:
            return None

    def _write_owner(self, owner: dict[str, Any]) -> None:
        with _translated(self.describe(LEASE_NAME)):
            self.fs.pipe_file(self._abs(LEASE_NAME), encode_owner(owner))

    def writer_lease(self, owner: dict[str, Any], timeout: float) -> WriterLease:
        holder: list[dict[str, Any] | None] = [None]

        def attempt() -> bool:
            current = self._read_owner()
            if current is not None and current.get("token") != owner["token"] and _alive(current):
                holder[0] = current
                return False
            self._write_owner(owner)
            again = self._read_owner()  # a writer that started at the same moment may have won
            if again is None or again.get("token") != owner["token"]:
                holder[0] = again
                return False
            return True

        if not poll_until(attempt, timeout):
            raise LeaseBusy(describe_owner(holder[0]))
        return _ObjectLease(self, owner)
