"""The writer lease: one writer per checkpoint root, any number of readers.

A writer (a Checkpointer from its first save to ``close()``, a bare write transaction or a
gc for their duration) holds ``ROOT/writer``. Backends implement the lease
(:meth:`~gpusnap.storage.backend.Backend.writer_lease`): a local directory with an
exclusive ``flock`` (released by the kernel when the process dies, SIGKILL included), an
fsspec store with a lease object naming its owner (see ``fsspec_backend``). The file holds
the owner's JSON (:func:`owner_info`), so a refused writer can say who holds the root.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

__all__ = [
    "LEASE_NAME", "LeaseBusy", "LeaseHolds", "WriterLease", "describe_owner", "encode_owner", "owner_info", "parse_owner",
]

LEASE_NAME = "writer"


class WriterLease(Protocol):
    """A held writer lease; ``release()`` is idempotent."""

    def confirm(self) -> None:
        """Raise :class:`OSError` if the lease was lost (an object-store lease taken over
        after it went stale); else renew it. Called before each commit."""
        ...

    def release(self) -> None: ...


class LeaseBusy(TimeoutError):
    """Another writer holds the lease; ``holder`` describes it for messages."""

    def __init__(self, holder: str) -> None:
        super().__init__(f"writer lease held by {holder}")
        self.holder = holder


def owner_info() -> dict[str, Any]:
    """Who is taking the lease: written into the lease file for the next writer's message."""
    now = time.time()
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": now, "renewed": now,
            "token": secrets.token_hex(8)}


def encode_owner(info: dict[str, Any]) -> bytes:
    return json.dumps(info, sort_keys=True).encode("utf-8")


def parse_owner(data: bytes) -> dict[str, Any] | None:
    """The owner JSON, or None when the file is empty or unreadable (a writer mid-write)."""
    try:
        info = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def describe_owner(info: dict[str, Any] | None) -> str:
    if not info:
        return "another writer (it did not record who it is)"
    since = info.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) if isinstance(since, (int, float)) else "?"
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')} (writing since {when})"


class LeaseHolds:
    """One Repository's holds on its root's writer lease: the lease is taken at the first hold
    and released with the last. A Checkpointer holds it from its first save to ``close()``
    (``persistent``); each write transaction and gc holds it while it runs. Thread-safe."""

    def __init__(self, take: Callable[[dict[str, Any], float], WriterLease]) -> None:
        self._take = take
        self._lock = threading.Lock()
        self._lease: WriterLease | None = None
        self._holds = 0
        self.persistent = False

    @property
    def held(self) -> bool:
        return self._lease is not None

    def hold(self, timeout: float) -> None:
        """Add a hold; raises :class:`LeaseBusy` (after ``timeout``) or :class:`OSError`."""
        with self._lock:
            if self._lease is None:
                self._lease = self._take(owner_info(), timeout)
            self._holds += 1

    def drop(self) -> None:
        with self._lock:
            self._holds -= 1
            lease = self._lease if self._holds == 0 else None
            if lease is not None:
                self._lease = None
        if lease is not None:
            lease.release()

    def confirm(self) -> None:
        with self._lock:
            lease = self._lease
        if lease is not None:
            lease.confirm()
