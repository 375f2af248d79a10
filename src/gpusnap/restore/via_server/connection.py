"""Connecting to a restore server: the socket, the peer's user checked, its hello read.

Used by a restore asking the server (``via_server.client``), by the server itself
(:func:`peer`) and by its control requests (``gpusnap.serving.connect.ask``).
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

from gpusnap.restore.via_server import protocol

__all__ = ["connect", "peer", "read_hello"]

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
    """The server's hello; ``ProtocolError`` if it is not a server of this protocol version."""
    hello, fds = protocol.recv_msg(conn, deadline)
    for fd in fds:
        os.close(fd)
    if not isinstance(hello, dict) or hello.get("v") != protocol.VERSION:
        raise protocol.ProtocolError(f"not a gpusnap restore server of protocol {protocol.VERSION}: {hello!r:.80}")
    return hello
