"""``gpusnap serve ROOT --pool N --entry module:function``: the restore server and a warm
pool in one process. The pool's processes restore from that server; a ``take`` request on
its socket (:func:`gpusnap.pool.take_from`) hands one of them a checkpoint.

Order: the server starts and holds the newest checkpoints ("ready"), then the pool starts
its processes. On SIGTERM/SIGINT the server stops (requests in flight finish), then the pool
is closed: its processes, taken ones included, stopped and reaped.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import torch

from gpusnap.config import Config
from gpusnap.pool.child import Output
from gpusnap.pool.pool import Pool
from gpusnap.serving.server import Server

__all__ = ["serve_pool"]


def serve_pool(root: str | os.PathLike[str], entry: str | Callable[..., Any], size: int, *, keep: int = 1,
               device: str | torch.device | None = None, socket: str | None = None, poll_s: float = 1.0,
               config: Config | None = None, stdout: Output = None,
               on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Run a restore server for ``root`` with a pool of ``size`` processes of ``entry`` on
    its device, until SIGTERM or SIGINT (on the main thread). Raises as
    ``gpusnap.serving.serve`` does, and ``ValueError`` for a bad entry or size (before
    anything starts).

    >>> serve_pool("/dev/shm/run1/ckpt", "my_server:serve", 2, on_event=print)   # doctest: +SKIP
    """
    holder: dict[str, Pool] = {}
    made = threading.Event()  # (a take that comes while the pool is being made waits for it)

    def take(msg: dict[str, Any]) -> dict[str, Any]:
        made.wait()
        pool = holder.get("pool")
        if pool is None:
            return {"ok": False, "code": "error", "why": "the pool could not be started"}
        checkpoint = msg.get("checkpoint")
        proc = pool.take(checkpoint if isinstance(checkpoint, str) else None, params=msg.get("params") or {})
        return {"ok": True, "pid": proc.pid, "checkpoint": proc.checkpoint, "stats": dict(proc.stats)}

    Pool.check(entry, size)  # (a bad entry or size is refused before the server takes the root)
    if socket is not None:  # the processes' restores must ask this server, not the one the root names
        config = dataclasses.replace(config or Config.from_env(warm_up_kernels=False), restore_server_socket=socket)
    server = Server(root, keep=keep, device=device, socket=socket, poll_s=poll_s, config=config, on_event=on_event,
                    ops={"take": take})
    previous = {s: signal.signal(s, lambda *_: server.stop()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.start()
        try:
            pool = Pool(server.root, entry, size, device=server.device, config=config, stdout=stdout,
                        on_event=on_event)
            holder["pool"] = pool
        finally:
            made.set()
        with pool:
            server.serve_forever()  # (until stop(): then the server closes, and the pool)
    finally:
        made.set()
        server.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if server.broken is not None:
        raise RuntimeError(f"gpusnap serve stopped: {server.broken}")
