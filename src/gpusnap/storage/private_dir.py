"""Directories and files only this user may touch: what a local checkpoint root, a fast
root and the restore server's socket directory must be.

Another local user who can write a root (or create it first, at a predictable path such as
``/dev/shm/run1``) could read every checkpoint saved there, or plant a link that makes a save
overwrite one of our files with tensor bytes. So a directory gpusnap writes into must be
owned by this (effective) user, writable by nobody else, and reached through no directory
where anyone may rename entries (world-writable without the sticky bit) nor through a link
another user owns; a missing one is created mode 0700. Files in it are created 0600, opened
without following a link, and refused unless they are regular files of ours.

A refusal is a :class:`NotPrivate`, a ``PermissionError`` (backends raise ``OSError``; the
repository turns it into a one-line ``StorageError``) whose message names the path, what was
found and the fix.

>>> import tempfile
>>> d = ensure_private_dir(os.path.join(tempfile.mkdtemp(), "root"))
>>> oct(os.stat(d).st_mode & 0o777)
'0o700'
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["NotPrivate", "ensure_private_dir", "open_private"]


class NotPrivate(PermissionError):
    """A directory or file that others could read, replace or redirect (``errno`` EACCES)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EACCES, message)

    def __str__(self) -> str:
        return str(self.strerror)


def _refused(what: str, path: str, found: str, fix: str) -> NotPrivate:
    return NotPrivate(
        f"{what} {path} must be a directory this user (uid {os.geteuid()}) owns and only it may write: "
        f"{found}; {fix}",
    )


def ensure_private_dir(path: str | os.PathLike[str], *, what: str = "the checkpoint root",
                       create: bool = True, elsewhere: str = "pick a directory you own") -> str:
    """Check the directory ``path`` as the module docstring says (``create``: first make it,
    mode 0700, and its missing parents) and return its absolute path; :class:`NotPrivate`
    saying how to fix it otherwise (``elsewhere``: how to use another directory)."""
    text = os.path.abspath(os.fspath(path))
    if create and not os.path.lexists(text):
        _make_parents(os.path.dirname(text))
        _check_way(text, what, elsewhere)  # (before anything is made there)
        try:
            os.mkdir(text, 0o700)
        except FileExistsError:
            pass  # (made meanwhile, maybe by someone else: checked below like any other)
    real = _check_way(text, what, elsewhere)
    info = os.stat(real)
    if not stat.S_ISDIR(info.st_mode):
        raise _refused(what, text, "it is not a directory", elsewhere)
    if info.st_uid != os.geteuid():
        raise _refused(what, text, f"it is owned by uid {info.st_uid}",
                       f"remove it (its owner may have planted it), make it yours (chown; in a container "
                       f"writing to a mounted volume: run as the volume's owner, e.g. docker run --user), "
                       f"or {elsewhere}")
    if info.st_mode & 0o022:
        raise _refused(what, text, f"others may write it (mode {stat.S_IMODE(info.st_mode):04o})",
                       f"run chmod go-w {real}, or {elsewhere}")
    return text


def _make_parents(parent: str) -> None:
    """Make ``parent`` and its missing ancestors, each at most mode 0755 (``os.makedirs`` makes
    intermediate ones 0777 less the umask: under umask 000 writable by anyone, which the
    check of the way to the root then refuses)."""
    missing = []
    while parent and not os.path.lexists(parent):
        missing.append(parent)
        up = os.path.dirname(parent)
        if up == parent:
            break
        parent = up
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o755)
        except FileExistsError:
            pass


def _check_way(text: str, what: str, elsewhere: str) -> str:
    """Refuse a way to ``text`` that another user could redirect: through their link, or through
    a directory where anyone may rename entries (world-writable without the sticky bit that
    ``/tmp`` and ``/dev/shm`` have). Returns ``text`` with links resolved."""
    _check_links(text, what, elsewhere)
    real = os.path.realpath(text)
    parent = os.path.dirname(real)
    while True:
        up = os.stat(parent)
        if up.st_mode & stat.S_IWOTH and not up.st_mode & stat.S_ISVTX:
            raise _refused(what, text, f"anyone may rename entries of {parent} (mode {stat.S_IMODE(up.st_mode):04o}, "
                           "no sticky bit), so another user could put their own directory in its place",
                           f"run chmod o-w {parent} (or chmod +t {parent}), or {elsewhere}")
        if parent == os.path.dirname(parent):
            return real
        parent = os.path.dirname(parent)


def _check_links(text: str, what: str, elsewhere: str) -> None:
    """Refuse a path through a symbolic link another user owns (they may point it anywhere);
    our own links, and root's (``/tmp`` -> ``/private/tmp``), are fine."""
    prefix = os.sep
    for part in text.split(os.sep):
        if not part:
            continue
        prefix = os.path.join(prefix, part)
        try:
            info = os.lstat(prefix)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(info.st_mode) and info.st_uid not in (os.geteuid(), 0):
            raise _refused(what, text, f"{prefix} is a symbolic link owned by uid {info.st_uid}",
                           f"give the path it points to, if you trust it, or {elsewhere}")


def open_private(path: str, flags: int) -> int:
    """``os.open(path, flags)`` of a file in a private directory: created mode 0600, never
    through a link at ``path``, and refused (the descriptor closed) unless the file is a
    regular file this user owns."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise NotPrivate(f"{path} is a symbolic link: gpusnap follows no link to a file "
                                  "it writes or maps (another user may have planted it); remove it") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotPrivate(f"{path} is not a regular file: remove it")
        if info.st_uid != os.geteuid():
            raise NotPrivate(f"{path} is owned by uid {info.st_uid}, not this user "
                                  f"(uid {os.geteuid()}): another user may have planted it; remove it")
        if stat.S_IMODE(info.st_mode) & 0o077:  # (made by an older gpusnap, 0644: what it will hold is private)
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd
