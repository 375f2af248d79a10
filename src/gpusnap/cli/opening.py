"""Opening a root for the CLI, with errors worded for someone at a shell.

The library's "no checkpoint root" covers a missing path and an empty directory, and speaks to
a program that saves; here the path is looked at directly, so the message says which case it
is, for someone at a shell (a permission problem is reported as one). A directory of other
files is not one to "pick" (that is advice for a save): the commands here only read, so the
message asks to check the path and names the roots just inside or around it.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from gpusnap.errors import CheckpointError, CheckpointNotFoundError, StorageError
from gpusnap.storage.backend import Backend, LocalBackend, open_backend
from gpusnap.storage.layout import ROOT_FILE
from gpusnap.storage.repository import Repository

__all__ = ["open_root"]

_HOW = "a root is made by the first save of a gpusnap.Checkpointer"
_LOOKED_AT = 100  # entries of a foreign directory checked for a root inside it


def open_root(root: str) -> Repository:
    """The existing root at ``root`` (path or fsspec URL); never creates one."""
    backend = open_backend(root)
    try:
        return Repository.open(root, create=False, backend=backend)
    except CheckpointNotFoundError as exc:
        raise _why_missing(backend) from exc
    except CheckpointError as exc:
        if not _foreign_directory(backend):
            raise
        raise CheckpointNotFoundError(
            f"{backend.root} is not a gpusnap checkpoint root (it holds other files, no {ROOT_FILE}): "
            f"check the path{_roots_near(backend)}"
        ) from exc


def _foreign_directory(backend: Backend) -> bool:
    try:
        return backend.isdir("") and not backend.exists(ROOT_FILE)
    except OSError:
        return False


def _roots_near(backend: Backend) -> str:
    """Where the root may be: a directory just inside this one, or one above it (local paths)."""
    inside: list[str] = []
    try:
        for name in sorted(backend.listdir(""))[:_LOOKED_AT]:
            if backend.exists(f"{name}/{ROOT_FILE}"):
                inside.append(f"{backend.root.rstrip('/')}/{name}")
    except OSError:
        pass
    if inside:
        return f"; checkpoint roots inside it: {', '.join(inside[:5])}"
    if isinstance(backend, LocalBackend):
        above = next((p for p in Path(backend.root).resolve().parents if (p / ROOT_FILE).is_file()), None)
        if above is not None:
            return f"; it is inside the checkpoint root {above}"
    return ""


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
