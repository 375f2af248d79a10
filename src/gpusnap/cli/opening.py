"""Opening a root for the CLI, with errors worded for someone at a shell.

The library's "no checkpoint root" covers a missing path and an empty directory, and speaks to
a program that saves; here the path is looked at directly, so the message says which case it
is, for someone at a shell (a permission problem is reported as one).
"""

from __future__ import annotations

import errno
import os

from gpusnap.errors import CheckpointNotFoundError, StorageError
from gpusnap.storage.backend import LocalBackend, open_backend
from gpusnap.storage.repository import Repository

__all__ = ["open_root"]

_HOW = "a root is made by the first save of a gpusnap.Checkpointer"


def open_root(root: str) -> Repository:
    """The existing root at ``root`` (path or fsspec URL); never creates one."""
    backend = open_backend(root)
    try:
        return Repository.open(root, create=False, backend=backend)
    except CheckpointNotFoundError as exc:
        raise _why_missing(backend) from exc


def _why_missing(backend: object) -> Exception:
    if not isinstance(backend, LocalBackend):
        where = getattr(backend, "root", "?")
        return CheckpointNotFoundError(f"no checkpoint root at {where}: nothing is stored there ({_HOW})")
    path = backend.root
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return CheckpointNotFoundError(f"no checkpoint root at {path}: no such directory ({_HOW})")
    except OSError as exc:
        name = errno.errorcode.get(exc.errno or 0, "")
        reason = f"{exc.strerror or exc} [{name}]" if name else str(exc)
        hint = "; check the permissions of it and of its parent directories" if exc.errno == errno.EACCES else ""
        return StorageError(f"cannot open checkpoint root {path}: {reason}{hint}")
    return CheckpointNotFoundError(f"no checkpoint root at {path}: the directory holds no checkpoints ({_HOW})")
