"""Connecting to a restore server: the socket, the peer's user checked, its hello read.

Used by the restore's client (``restore.server_client``) and by :func:`ask`, which sends the
server a control request: ``status`` (what it holds) or ``refresh`` (hold the newest
checkpoints now, then answer: tests and benchmarks use it instead of waiting for a poll).

>>> ask("/dev/shm/run1/ckpt", "refresh")["held"][0]["id"]   # doctest: +SKIP
'20261202-101500-042-1a2b3c'
"""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Any

from gpusnap.serving import paths, protocol

__all__ = ["ask", "connect", "read_hello"]

PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer(conn: socket.socket) -> tuple[int, int]:
    """The ``(pid, uid)`` of the process at the other end of a Unix socket."""
    pid, uid, _ = PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
    return pid, uid


def connect(path: str, *, timeout: float) -> tuple[socket.socket, int]:
    """A connection to the server at ``path`` and its pid. ``ConnectionRefusedError`` /
    ``FileNotFoundError``: no server listens (a stale socket, or none); ``PermissionError``:
    another user's process listens there; other ``OSError``: it did not accept in time."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        conn.settimeout(timeout)
        conn.connect(path)
        pid, uid = peer(conn)
        if uid != os.getuid():
            raise PermissionError(f"{path} is served by user {uid}, not this one")
    except BaseException:
        conn.close()
        raise
    return conn, pid


def read_hello(conn: socket.socket, deadline: float) -> dict[str, Any]:
    hello, fds = protocol.recv_msg(conn, deadline)
    for fd in fds:
        os.close(fd)
    if not isinstance(hello, dict) or hello.get("v") != protocol.VERSION:
        raise protocol.ProtocolError(f"not a gpusnap restore server of protocol {protocol.VERSION}: {hello!r:.80}")
    return hello


def ask(root: str | os.PathLike[str] | None, op: str, *, socket_path: str | None = None,
        timeout: float = 600.0) -> dict[str, Any]:
    """Send control request ``op`` (``status`` or ``refresh``) to the server of ``root`` (or
    at ``socket_path``) and return its reply (``{"ok", "held": [...], "failed": {...}}``).
    Raises ``OSError`` when no server answers."""
    path = socket_path or paths.socket_path(root)  # type: ignore[arg-type]
    deadline = time.monotonic() + timeout
    conn, _ = connect(path, timeout=min(timeout, 5.0))
    with conn:
        read_hello(conn, deadline)
        protocol.send_msg(conn, {"op": op})
        reply, fds = protocol.recv_msg(conn, deadline)
        for fd in fds:
            os.close(fd)
    return reply  # type: ignore[no-any-return]
