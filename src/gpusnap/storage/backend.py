"""Where bytes go: the small :class:`Backend` protocol and the local-directory backend.

The repository never touches files directly; it speaks to a backend with paths relative to
the checkpoint root, always ``/``-separated (``"packs/ab/ab12....pack"``). The protocol is
small on purpose so that a fault-injecting wrapper (tests) or an object store (fsspec) fits.

Call order the repository follows (and a backend may rely on):

* write a file: ``makedirs(dir)`` -> ``open_write("tmp/x")`` -> ``write(...)``\\* ->
  ``close(sync=True)`` -> ``rename("tmp/x", final)`` -> ``sync_dir(dir of final)``.
  Nothing is ever written in place under its final name, and committed files are never
  modified afterwards (packs and manifests are immutable).
* read: ``listdir`` / ``exists`` / ``size``, then ``read_range`` or ``readinto_range``.
* delete: ``remove(path)`` then ``sync_dir``; removing a missing file is not an error
  (another process's gc may have been first).
* locking: ``lock(exclusive=False)`` for the life of a write transaction,
  ``lock(exclusive=True)`` for gc; ``release()`` on the returned handle.
* the writer lease (``storage.lease``): ``writer_lease(owner, timeout)`` before any write
  transaction or gc, ``confirm()`` before each commit, ``release()`` when done writing.

Every method raises :class:`OSError` (with ``errno`` set) on failure; translating that into
:class:`gpusnap.StorageError` with a useful message is the repository's job.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import weakref
from typing import Any

from gpusnap.fork_safety import at_fork
from gpusnap.storage.backend_protocol import (
    Backend,
    BackendLock,
    WriteHandle,
    poll_until,
)
from gpusnap.storage.direct_file import DirectFile
from gpusnap.storage.flock_probe import flock_held, try_flock
from gpusnap.storage.lease import (
    LEASE_NAME,
    LeaseBusy,
    WriterLease,
    describe_owner,
    encode_owner,
    parse_owner,
)
from gpusnap.storage.private_dir import ensure_private_dir, open_private

__all__ = [
    "Backend",
    "BackendLock",
    "LocalBackend",
    "WriteHandle",
    "open_backend",
]


class _LocalWriteHandle:
    """An ``os.open`` file descriptor; ``os.write`` takes memoryviews without copying."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def write(self, data: bytes | memoryview) -> None:
        if self._fd is None:
            raise ValueError("write to a closed file")
        view = memoryview(data)
        while len(view):
            written = os.write(self._fd, view)
            view = view[written:]

    def close(self, *, sync: bool) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)


def fsync_path(path: str) -> None:
    """fsync the file or directory at ``path`` (a directory: the names in it survive a power loss)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file and directory under ``path`` (``path`` itself included, file or directory)."""
    targets = [path] if os.path.isfile(path) else []
    for dirpath, _dirs, files in os.walk(path):
        targets += [os.path.join(dirpath, f) for f in files] + [dirpath]
    for p in targets:
        fsync_path(p)


class _FlockLock:
    """``fcntl.flock`` on an open file descriptor; closing the descriptor releases it."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


class _FlockLease:
    """The writer lease on a local root: an exclusive ``flock`` on ``ROOT/writer``, which
    holds the owner's JSON. The kernel drops it when the process dies; dropping the object
    without ``release()`` closes the descriptor too.

    A forked child (a DataLoader worker, say) inherits the descriptor, and a flock lasts while
    any descriptor of it is open: the child closes its copy at once (``_after_fork``), which
    leaves the parent's lock alone, so the child is no writer and does not keep the root
    locked after the parent dies."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd
        self._forked = False
        self._closer = weakref.finalize(self, os.close, fd)
        _flock_leases.add(self)

    def confirm(self) -> None:
        # a flock cannot be taken away while its descriptor is open; a child has none
        if self._forked:
            raise OSError(errno.EPERM, "a forked child process inherits no writer lease")

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)  # the next refused writer must not name a writer long gone
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass
        finally:
            self._closer()  # (closing the descriptor also releases the flock)

    def _forget_in_child(self) -> None:
        fd, self._fd = self._fd, None
        self._forked = True
        self._closer.detach()
        if fd is not None:
            try:
                os.close(fd)  # not LOCK_UN: that would unlock the parent's lock too
            except OSError:
                pass


_flock_leases: weakref.WeakSet[_FlockLease] = weakref.WeakSet()


def _after_fork() -> None:
    for lease in list(_flock_leases):
        lease._forget_in_child()


at_fork(after_in_child=_after_fork)




class LocalBackend:
    """A directory on a local (POSIX) filesystem.

    Locking uses ``fcntl.flock`` on ``ROOT/lock``: each lock opens its own descriptor, so two
    :class:`~gpusnap.storage.repository.Repository` objects in one process exclude each other
    exactly as two processes do.

    Writing needs a private root (``storage/private_dir.py``): it is created mode 0700 and
    checked before the first write, files are created 0600 and opened without following
    links. Reading does not: another user's root may be read where they allow it.
    """

    LOCK_NAME = "lock"

    def __init__(self, root: str | os.PathLike[str], *, what: str = "the checkpoint root") -> None:
        self.root: str = os.path.abspath(os.fspath(root))
        self._what = what  # (how a refusal names the root)
        self._private = False  # the root passed ensure_private_dir (once per object)

    def _writable_root(self) -> None:
        if not self._private:
            ensure_private_dir(self.root, what=self._what)
            self._private = True

    def __repr__(self) -> str:
        return f"LocalBackend({self.root!r})"

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/")) if path else self.root

    def describe(self, path: str) -> str:
        return self._abs(path)

    def exists(self, path: str) -> bool:
        # only "not there" is False: os.path.exists would hide a permission error as absence
        try:
            os.stat(self._abs(path))
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def isdir(self, path: str) -> bool:
        try:
            return stat.S_ISDIR(os.stat(self._abs(path)).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False

    def makedirs(self, path: str) -> None:
        ensure_private_dir(self.root, what=self._what)  # (each time: the root may have been removed and made anew)
        self._private = True
        if path:
            os.makedirs(self._abs(path), mode=0o700, exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(self._abs(path)))

    def size(self, path: str) -> int:
        return os.stat(self._abs(path)).st_size

    def open_write(self, path: str) -> WriteHandle:
        self._writable_root()
        return _LocalWriteHandle(open_private(self._abs(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC))

    def open_direct_write(self, path: str) -> DirectFile:
        """Like :meth:`open_write`, for aligned O_DIRECT writes straight from the caller's
        memory (``storage/direct_file.py``; buffered where the file system refuses O_DIRECT)."""
        self._writable_root()
        return DirectFile.open(self._abs(path))

    def rename(self, src: str, dst: str) -> None:
        os.replace(self._abs(src), self._abs(dst))

    def read_range(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        fd = os.open(self._abs(path), os.O_RDONLY | os.O_CLOEXEC)
        try:
            if length is None:
                length = max(0, os.fstat(fd).st_size - offset)
            parts: list[bytes] = []
            got = 0
            while got < length:
                part = os.pread(fd, length - got, offset + got)
                if not part:
                    break
                parts.append(part)
                got += len(part)
            return parts[0] if len(parts) == 1 else b"".join(parts)
        finally:
            os.close(fd)

    def local_path(self, path: str) -> str:
        """Where ``path`` lives on the local file system (restore reader processes open it)."""
        return self._abs(path)

    def readinto_range(self, path: str, offset: int, out: memoryview) -> int:
        view = memoryview(out).cast("B") if memoryview(out).format != "B" else memoryview(out)
        fd = os.open(self._abs(path), os.O_RDONLY | os.O_CLOEXEC)
        try:
            got = 0
            while got < len(view):
                n = os.preadv(fd, [view[got:]], offset + got)
                if n == 0:
                    break
                got += n
            return got
        finally:
            os.close(fd)

    def remove(self, path: str) -> None:
        try:
            os.remove(self._abs(path))
        except FileNotFoundError:
            pass

    def sync_dir(self, path: str) -> None:
        fd = os.open(self._abs(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def lock(self, *, exclusive: bool, timeout: float) -> BackendLock:
        lock_path = self._abs(self.LOCK_NAME)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            # A read-only medium still allows flock on an existing file opened read-only.
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            acquired = poll_until(lambda: try_flock(fd, shared=not exclusive), timeout)
        except BaseException:
            os.close(fd)
            raise
        if not acquired:
            os.close(fd)
            raise TimeoutError(errno.EWOULDBLOCK, "lock busy", lock_path)
        return _FlockLock(fd)

    def writer_held(self) -> bool:
        """Whether a live process holds this root's writer lease. A probe: it takes the lock
        for an instant when it is free, so ask only about a writer known to have taken it
        (the kernel drops a dead process's flock: a writer SIGKILLed reads as gone)."""
        return flock_held(self._abs(LEASE_NAME))

    def writer_lease(self, owner: dict[str, Any], timeout: float) -> WriterLease:
        self._writable_root()
        fd = open_private(self._abs(LEASE_NAME), os.O_RDWR | os.O_CREAT)
        try:
            if not poll_until(lambda: try_flock(fd), timeout):
                raise LeaseBusy(describe_owner(parse_owner(os.pread(fd, 4096, 0))))
            os.ftruncate(fd, 0)
            os.pwrite(fd, encode_owner(owner), 0)
        except BaseException:
            os.close(fd)
            raise
        return _FlockLease(fd)


def open_backend(root: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Backend:
    """A backend for ``root``: a plain path or ``file://`` URL is local, any other URL uses fsspec.

    >>> type(open_backend("/tmp/x")).__name__
    'LocalBackend'
    """
    if not isinstance(root, str):
        return LocalBackend(root)
    protocol, sep, rest = root.partition("://")
    if not sep:
        return LocalBackend(root)
    if protocol == "file":
        return LocalBackend(rest)
    from gpusnap.storage.fsspec_backend import FsspecBackend

    return FsspecBackend(root, storage_options)
