"""Taking a process from the pool of ``gpusnap serve ROOT --pool N`` (``pool.serve``), from
any process of the same user: :func:`take_from`, a ``take`` request on the server's socket.

>>> take_from("/dev/shm/run1/ckpt", params={"port": 8001}).pid   # doctest: +SKIP
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpusnap.pool.messages import PoolError, as_params, raise_error
from gpusnap.restore.via_server import paths, protocol
from gpusnap.restore.via_server.connection import connect, read_hello

__all__ = ["Handed", "take_from"]


@dataclass(frozen=True)
class Handed:
    """A process the server's pool handed ``checkpoint`` (its id) and that now runs the
    entry: its ``pid`` (a child of the server: it stops with the server) and ``stats``
    (as ``PoolProcess.stats``)."""

    pid: int
    checkpoint: str
    stats: Mapping[str, Any]


def take_from(root: str | os.PathLike[str], checkpoint: str | None = None, *, params: Mapping[str, Any] | None = None,
              socket: str | None = None, timeout: float = 600.0) -> Handed:
    """Ask the pool of the server of ``root`` (or listening at ``socket``) for a process
    serving ``checkpoint`` (id, tag, None: the newest), as ``Pool.take`` would; returns once
    its weights are in place. Raises ``OSError`` when no server answers, :class:`PoolError`
    when it has no pool or the take failed (or the load's own error, as ``Pool.take``)."""
    if checkpoint is not None and not isinstance(checkpoint, str):
        raise TypeError(f"checkpoint is an id or a tag (a string) or None, got {checkpoint!r}")
    path = socket or paths.socket_path(root)
    deadline = time.monotonic() + timeout
    conn, _ = connect(path, timeout=min(timeout, 5.0))
    with conn:
        read_hello(conn, deadline)
        protocol.send_msg(conn, {"op": "take", "checkpoint": checkpoint, "params": as_params(params)})
        reply, fds = protocol.recv_msg(conn, deadline)
        for fd in fds:
            os.close(fd)
    if not isinstance(reply, dict):
        raise PoolError(f"the server at {path} answered {reply!r:.80}")
    if not reply.get("ok"):
        why = str(reply.get("why", reply))
        if "unknown op" in why:
            raise PoolError(f"the server of {root} runs no pool (start it with --pool N --entry module:function)")
        raise_error({"type": reply.get("type"), "message": why}, f"the pool of the server at {path}")
    return Handed(int(reply["pid"]), str(reply["checkpoint"]), reply.get("stats") or {})
