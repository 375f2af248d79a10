"""Write an export under a temporary name beside its destination, then rename it into place:
a failure at any moment (a refused tensor, a full disk, Ctrl-C) leaves nothing at the
destination but what was there before."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from gpusnap.interop.errors import FormatError
from gpusnap.storage.backend import fsync_path, fsync_tree

__all__ = ["staged"]


@contextmanager
def staged(path: str | os.PathLike[str], *, directory: bool, overwrite: bool) -> Iterator[str]:
    """A temporary path to write to (an empty directory when ``directory``), made durable and
    renamed onto ``path`` when the block succeeds, removed when it raises.

    ``path`` must be local and its parent must exist; an existing ``path`` is a
    FileExistsError unless ``overwrite``, when it is replaced only once the new one is whole.
    """
    dest = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(dest)
    if not os.path.isdir(parent):
        raise FormatError(f"{os.fspath(path)}: no such directory {parent}")
    if os.path.lexists(dest) and not overwrite:
        raise FileExistsError(f"{os.fspath(path)} exists; pass overwrite=True (--force) to replace it")
    tmp = os.path.join(parent, f".{os.path.basename(dest)}.gpusnap-{secrets.token_hex(4)}.tmp")
    if directory:
        os.mkdir(tmp)
    try:
        yield tmp
        fsync_tree(tmp)
        _publish(tmp, dest)
    except BaseException:
        _remove(tmp)
        raise
    fsync_path(parent)


def _publish(tmp: str, dest: str) -> None:
    if not os.path.lexists(dest) or (os.path.isfile(tmp) and not os.path.isdir(dest)):
        os.replace(tmp, dest)  # atomic, over a file too
        return
    aside = f"{tmp}.old"  # a directory cannot be replaced in one rename: the old one steps aside
    os.rename(dest, aside)
    try:
        os.rename(tmp, dest)
    except BaseException:
        os.rename(aside, dest)
        raise
    _remove(aside)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)
