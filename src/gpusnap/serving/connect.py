"""Control requests to a restore server: :func:`ask` sends ``status`` (what it holds) or
``refresh`` (hold the newest checkpoints now, then answer: tests and benchmarks use it
instead of waiting for a poll).

>>> ask("/dev/shm/run1/ckpt", "refresh")["held"][0]["id"]   # doctest: +SKIP
'20261202-101500-042-1a2b3c'
"""

from __future__ import annotations

import os
import time
from typing import Any

from gpusnap.restore.via_server import paths, protocol
from gpusnap.restore.via_server.connection import connect, read_hello

__all__ = ["ask"]


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
