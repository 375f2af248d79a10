"""What a pool and one of its processes say to each other: JSON messages over a socket pair
(the framing is the restore server's, ``restore.via_server.protocol``).

The pair is made by the pool and one end passed to the process at its start: no path on any
file system, so nobody else can connect, and the process sees its end close when the pool's
process ends, however it ends. In order::

    pool -> process   start     {"op": "start", "root", "entry", "device", "key", "config", "seq", "sys_path"}
    process -> pool   ready     {"op": "ready", "pid", "device", "import_s", "cuda_s", "build_s", "warm_up_s"}
                      or failed {"op": "failed", "stage": "start", "error": {...}}   (then it exits)
    pool -> process   take      {"op": "take", "checkpoint": id, tag or None, "params": {...}}
    process -> pool   loaded    {"op": "loaded", "checkpoint", "stats": {...}}   (every weight in place)
                      or failed {"op": "failed", "stage": "load", "error": {...}}    (then it exits)
    process -> pool   returned  {"op": "returned", "value": ...}                   (the entry returned)
                      or failed {"op": "failed", "stage": "serve", "error": {...}}   (the entry raised)

An error is ``{"type": class name, "message", "traceback"}``; :func:`raise_error` turns one
back into gpusnap's own exception types where it names one.
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from collections.abc import Mapping
from typing import Any

from gpusnap import errors
from gpusnap.restore.via_server import protocol

__all__ = ["PoolError", "as_params", "describe", "error_of", "raise_error", "recv", "send", "to_json"]

_FOREVER_S = 10 * 365 * 86400.0  # a process waits for its take as long as its pool lives


class PoolError(RuntimeError):
    """The pool could not hand over a process: none could start, or the one taken died or
    failed before every weight was in place (``str()`` says which, and why)."""


def send(sock: socket.socket, msg: dict[str, Any]) -> None:
    """One message; ``OSError`` when the other end is gone."""
    protocol.send_msg(sock, msg)


def recv(sock: socket.socket) -> dict[str, Any] | None:
    """The next message, or None once the other end has closed (or sent garbage: a process
    of ours never does, so it is treated as gone)."""
    try:
        msg, fds = protocol.recv_msg(sock, time.monotonic() + _FOREVER_S)
    except (OSError, TimeoutError):
        return None
    for fd in fds:  # (none are sent: a stray one is closed)
        os.close(fd)
    return msg if isinstance(msg, dict) else None


def error_of(exc: BaseException) -> dict[str, str]:
    """An exception as a message field."""
    return {"type": type(exc).__name__, "message": str(exc),
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))}


def describe(error: dict[str, Any]) -> str:
    """``Type: message`` of an error field (the message alone when it names no type)."""
    kind = error.get("type")
    return f"{kind}: {error.get('message', '')}" if kind else str(error.get("message", ""))


_KNOWN: dict[str, type[Exception]] = {cls.__name__: cls for cls in (
    errors.RestoreMismatchError, errors.CheckpointNotFoundError, errors.IntegrityError, errors.StorageError,
    errors.CheckpointError)}


def raise_error(error: dict[str, Any], context: str) -> None:
    """Raise ``error`` (from a process) as gpusnap's exception of that name, else as a
    :class:`PoolError`; ``context`` says which process and what it was doing."""
    cls = _KNOWN.get(str(error.get("type")))
    if cls is not None:
        raise cls(f"{context}: {error.get('message', '')}")
    raise PoolError(f"{context}: {describe(error)}")


def to_json(value: Any) -> Any:
    """``value`` as it crosses the socket (what JSON cannot hold, as its ``str``)."""
    return json.loads(json.dumps(value, default=str))


def as_params(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """A take's ``params`` as they cross to the process; ``TypeError`` unless JSON."""
    if params is None:
        return {}
    if not isinstance(params, Mapping) or not all(isinstance(k, str) for k in params):
        raise TypeError(f"params is a mapping of names to JSON values, got {params!r:.80}")
    try:
        return json.loads(json.dumps(dict(params)))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"params must be JSON (they cross to the pool process): {exc}") from None
