"""Files an import reads, kept inside the directory it was given: a DCP ``.metadata`` or a
Hugging Face index names files by path, and a hostile one names ``../../secret.pt``, an
absolute path, or a link planted in the directory that points out of it.

Every such path goes through :func:`inside` (its real path, links resolved, must lie in the
real path of the directory; else a FormatError naming the entry) and is opened with
:func:`opened`, which walks that real path one component at a time without following links,
so a link swapped in between the check and the open is refused, not followed. A link that
stays inside the directory is followed: it reads nothing the directory does not hold.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

from gpusnap.interop.errors import FormatError

__all__ = ["inside", "opened", "path_of"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # (a planted FIFO must not block the open)
_BY_FD = ("/proc/self/fd", "/dev/fd")
_WHY = "gpusnap import reads only files inside the directory it is given"
_COPY = " (to import a directory whose files link elsewhere, copy it with the links resolved: cp -rL DIR COPY)"


def inside(root: str, relpath: object, entry: str) -> str:
    """The real path of ``relpath`` under the directory ``root``. ``entry`` says where the path
    came from (``"hf/model.safetensors.index.json: shard"``) and starts the FormatError
    raised when ``relpath`` is absolute, not a path, or resolves outside ``root``."""
    base = os.path.realpath(root)
    rel = _text(relpath)
    if rel is None:
        raise _refused(entry, relpath, "not a relative file path")
    if os.path.isabs(rel) or os.path.splitdrive(rel)[0]:
        raise _refused(entry, relpath, "an absolute path")
    target = os.path.realpath(os.path.join(base, rel))
    if target == base:
        raise _refused(entry, relpath, f"names {base} itself, not a file in it")
    if os.path.commonpath([base, target]) != base:
        if os.path.normpath(os.path.join(base, rel)) == target:
            raise _refused(entry, relpath, f"leads to {target}, outside {base}")
        raise _refused(entry, relpath, f"a link to {target}, outside {base}", link=True)
    return target


def _text(relpath: object) -> str | None:
    """``relpath`` as a non-empty str path, or None when it is none (bytes, a number, a NUL)."""
    try:
        rel = os.fspath(relpath)  # type: ignore[arg-type]
    except TypeError:
        return None
    return rel if isinstance(rel, str) and rel and "\0" not in rel else None


@contextmanager
def opened(root: str, relpath: object, entry: str) -> Iterator[BinaryIO]:
    """``relpath`` under ``root``, checked by :func:`inside`, open for reading. Each component
    below the real ``root`` is opened relative to the one before it with ``O_NOFOLLOW``: a
    link that appears after the check is a FormatError, never followed. A missing file is
    FileNotFoundError, as ``open`` raises it."""
    target = inside(root, relpath, entry)
    base = os.path.realpath(root)
    if not _NOFOLLOW or os.open not in os.supports_dir_fd:  # (a system without them: the check, then a comparison)
        with open(target, "rb") as stream:
            if not os.path.samestat(os.fstat(stream.fileno()), os.stat(target)) or os.path.realpath(target) != target:
                raise _refused(entry, relpath, "changed while it was opened")
            yield stream
        return
    parts = os.path.relpath(target, base).split(os.sep)
    fd = os.open(base, os.O_RDONLY | _DIRECTORY)
    try:
        for part in parts[:-1]:
            fd, parent = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW, dir_fd=fd), fd
            os.close(parent)
        found = os.open(parts[-1], os.O_RDONLY | _NOFOLLOW | _NONBLOCK, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a component became a link after the check
            raise _refused(entry, relpath, "changed into a link while it was opened", link=True) from None
        raise
    finally:
        os.close(fd)
    stream = os.fdopen(found, "rb")
    with stream:
        if not stat.S_ISREG(os.fstat(found).st_mode):
            raise FormatError(f"{entry} {relpath!r}: not a regular file (a directory, a FIFO, a device)")
        os.set_blocking(found, True)
        yield stream


def path_of(stream: BinaryIO) -> str:
    """A path naming the very file :func:`opened` gave, for libraries that take only paths
    (safetensors, ``torch.load``): ``/proc/self/fd/N`` (or ``/dev/fd/N``), which reopens that
    file whatever its name points to now; else the checked real path it was opened by."""
    for by_fd in _BY_FD:
        if os.path.isdir(by_fd):
            return f"{by_fd}/{stream.fileno()}"
    return str(stream.name)


def _refused(entry: str, relpath: object, problem: str, *, link: bool = False) -> FormatError:
    return FormatError(f"{entry} {relpath!r}: {problem}: refused; {_WHY}{_COPY if link else ''}")
