"""The backend protocol: the storage primitives a checkpoint root needs (see ``storage.backend``
for the call order and the local-directory implementation, ``storage.fsspec_backend`` for
object stores), and the polling helper both backends' locks use."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from gpusnap.storage.lease import WriterLease

__all__ = ["Backend", "BackendLock", "WriteHandle", "poll_until"]


class WriteHandle(Protocol):
    """A file being written under a temporary name."""

    def write(self, data: bytes | memoryview) -> None:
        """Write all of ``data`` (looping over short writes) or raise :class:`OSError`."""
        ...

    def close(self, *, sync: bool) -> None:
        """Flush, ``fsync`` when ``sync`` (durability before a rename), then close.

        The handle is closed even when flushing or syncing raises.
        """
        ...


class BackendLock(Protocol):
    """A held root lock; ``release()`` is idempotent."""

    def release(self) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """Storage primitives relative to one checkpoint root. See the module docstring."""

    root: str
    """The root, as shown to users in messages."""

    def describe(self, path: str) -> str:
        """Full location of ``path`` for error messages (an absolute path or a URL)."""
        ...

    def exists(self, path: str) -> bool:
        """Whether ``path`` (``""`` is the root itself) exists, as a file or a directory."""
        ...

    def isdir(self, path: str) -> bool:
        """Whether ``path`` is a directory (object stores: a prefix with children)."""
        ...

    def makedirs(self, path: str) -> None:
        """Create ``path`` and its parents; existing directories are fine."""
        ...

    def listdir(self, path: str) -> list[str]:
        """Names (not paths) directly under ``path``, sorted; :class:`FileNotFoundError` if missing."""
        ...

    def size(self, path: str) -> int:
        """Size of a file in bytes."""
        ...

    def open_write(self, path: str) -> WriteHandle:
        """Create or truncate ``path`` for writing; the parent directory must exist."""
        ...

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst``, atomically replacing ``dst`` where the medium allows."""
        ...

    def read_range(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """Up to ``length`` bytes at ``offset`` (``None``: to the end); short only at end of file."""
        ...

    def readinto_range(self, path: str, offset: int, out: memoryview) -> int:
        """Fill ``out`` from ``offset`` without an intermediate copy where possible.

        Returns the number of bytes read, smaller than ``len(out)`` only at end of file.
        """
        ...

    def remove(self, path: str) -> None:
        """Delete a file; a missing file is not an error."""
        ...

    def sync_dir(self, path: str) -> None:
        """Make renames and removals in directory ``path`` durable (``fsync`` on the directory)."""
        ...

    def lock(self, *, exclusive: bool, timeout: float) -> BackendLock:
        """Take the root lock, shared or exclusive, waiting up to ``timeout`` seconds.

        ``timeout=0`` tries once. Raises :class:`TimeoutError` when the lock stays busy.
        """
        ...

    def writer_lease(self, owner: dict[str, Any], timeout: float) -> WriterLease:
        """Take the root's writer lease for ``owner`` (``lease.owner_info()``), waiting up to
        ``timeout`` seconds; raises :class:`~gpusnap.storage.lease.LeaseBusy` naming the holder.

        Exclusive between objects, not only processes: two leases taken through two backend
        objects on one root exclude each other.
        """
        ...


def poll_until(acquire: Callable[[], bool], timeout: float) -> bool:
    """Call ``acquire()`` until it returns True or ``timeout`` passes (short, growing sleeps)."""
    deadline = time.monotonic() + max(0.0, timeout)
    delay = 0.005
    while True:
        if acquire():
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.1)
