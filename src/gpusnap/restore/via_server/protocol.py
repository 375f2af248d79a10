"""The restore server's wire format: length-prefixed JSON over a Unix stream socket.

One connection serves one request::

    server -> client   hello    {"v", "pid", "root", "device", "held": {id: manifest digest}}
                                (with "busy": why, when it serves too many clients: no request)
    client -> server   request  {"op": "restore", "id", "digest", "dests": [...], "copies": [...]}
                                (file descriptors of "fd" destinations ride along, SCM_RIGHTS)
                       or       {"op": "status"} / {"op": "refresh"} / {"op": "missed", "id"}
    server -> client   reply    {"ok": true, "id", "digest", "bytes", "open_s", "copy_s"}
                                or {"ok": false, "code", "why"}

``dests`` lists where bytes go: ``{"kind": "cuda", "handle": hex of a cudaIpcMemHandle,
"size": n}`` (an allocation of the client's, on the server's device) or ``{"kind": "fd",
"fd": i, "size": n}`` (shared memory the client passed, its ``i``-th descriptor). ``copies``
are ``[span, span offset, length, dest, dest offset]``: span ``span`` of the checkpoint, as
the manifest numbers its storages. The reply comes once every copy has *completed*: the
client's bytes are in place when it reads ``"ok"`` (no CUDA event crosses the socket).

JSON, not pickle or marshal: a message is data only, whatever sends it. Frames are an
8-byte little-endian length, then the body; at most :data:`MAX_FRAME` bytes.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
import time
from typing import Any

__all__ = ["ALIGN", "MAX_FDS", "MAX_FRAME", "VERSION", "ProtocolError", "recv_msg", "send_msg"]

VERSION = 1
LEN = struct.Struct("<Q")
MAX_FRAME = 256 << 20  # a request for a model of 100k tensors is a few MiB; more is garbage
MAX_FDS = 4  # descriptors a request may carry
ALIGN = 4096  # spans in shared memory (held or landing) start on a page: the copy engine's reads stay aligned


class ProtocolError(OSError):
    """The peer sent something that is not a frame of this protocol, or went away mid-frame."""


def send_msg(sock: socket.socket, obj: Any, fds: tuple[int, ...] = ()) -> None:
    body = json.dumps(obj, separators=(",", ":")).encode()
    data = LEN.pack(len(body)) + body
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_msg(sock: socket.socket, deadline: float) -> tuple[Any, list[int]]:
    """One message and the descriptors that came with it, by ``deadline`` (``time.monotonic``):
    ``TimeoutError`` after it, :class:`ProtocolError` at a closed connection or garbage. The
    caller owns (and closes) the descriptors."""
    fds: list[int] = []
    try:
        head = _recv_exactly(sock, LEN.size, deadline, fds)
        (n,) = LEN.unpack(head)
        if n > MAX_FRAME:
            raise ProtocolError(f"a frame of {n} bytes (at most {MAX_FRAME})")
        body = _recv_exactly(sock, n, deadline, fds)
        return json.loads(body), fds
    except ValueError as exc:  # (json.JSONDecodeError, UnicodeDecodeError)
        _close_all(fds)
        raise ProtocolError(f"not a message: {exc}") from None
    except BaseException:
        _close_all(fds)
        raise


def _recv_exactly(sock: socket.socket, n: int, deadline: float, fds: list[int]) -> bytes:
    parts: list[bytes] = []
    got = 0
    space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no answer in time")
        sock.settimeout(left)
        try:
            data, ancillary, _, _ = sock.recvmsg(min(n - got, 1 << 20), space)
        except socket.timeout:
            raise TimeoutError("no answer in time") from None
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                passed = array.array("i")
                passed.frombytes(payload[: len(payload) - len(payload) % passed.itemsize])
                fds.extend(passed)
        if not data:
            raise ProtocolError("the connection closed" + (" mid-message" if got or parts else ""))
        parts.append(data)
        got += len(data)
    return b"".join(parts)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
