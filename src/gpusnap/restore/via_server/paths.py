"""Where the restore server of a root listens: a Unix socket in a directory only its user can enter.

The socket's name is derived from the root's real path, so a server and its clients find
each other from the root alone: ``$XDG_RUNTIME_DIR/gpusnap/serve-<hash>.sock``, or
``/tmp/gpusnap-<uid>/serve-<hash>.sock`` without ``XDG_RUNTIME_DIR``. Not in the root itself:
a root may be deep (a socket path has at most 107 bytes) or on a network file system. The
directory is made mode 0700 and refused unless this user owns it and nobody else may write
it (in ``/tmp`` another user could otherwise plant a socket that impersonates the server);
the socket is 0600, and both sides also check the peer's user id on connect.

>>> socket_path("/dev/shm/run1").endswith(".sock")  # doctest: +SKIP
True
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from gpusnap.storage.private_dir import ensure_private_dir

__all__ = ["lock_path", "private_dir", "real_root", "socket_path"]


def real_root(root: str | os.PathLike[str]) -> str:
    """The root's absolute path, links resolved: what names a root to a server."""
    return os.path.realpath(os.fspath(root))


def private_dir(*, create: bool) -> Path:
    """The per-user directory of sockets and locks; ``create`` makes it if missing. Raises
    ``PermissionError`` if it is someone else's or others may write it."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(runtime) / "gpusnap" if runtime else Path("/tmp") / f"gpusnap-{os.getuid()}"
    ensure_private_dir(path, what="the restore server's socket directory", create=create,
                       elsewhere="set XDG_RUNTIME_DIR to a directory you own")
    return path


def socket_path(root: str | os.PathLike[str], *, create: bool = False) -> str:
    """The socket of the restore server for ``root`` (``create``: make its directory)."""
    name = hashlib.sha256(real_root(root).encode()).hexdigest()[:20]
    return str(private_dir(create=create) / f"serve-{name}.sock")


def lock_path(socket: str) -> str:
    """The lock file that makes one server per socket (and so per root)."""
    return socket + ".lock"
