"""The target's doorbell: how the source says "a round committed" without the target polling.

The target binds a Unix datagram socket in the transport's private directory (0700, the
socket itself 0600: no other user can ring it) and waits on it with a timeout; the source
sends one byte after each round it sees committed and after the handoff. A ring carries no
data the target trusts: it only lists the transport again sooner. Where no bell can be
made (a transport that is a URL, a path too long for a socket) the target polls every
``poll_s``; the timeout of each wait is also how it notices a source that died.

>>> import tempfile, os
>>> bell = Bell(os.path.join(tempfile.mkdtemp(), "bell.sock"))
>>> ring(bell.path), bell.wait(60.0)
(True, True)
>>> bell.close()
"""

from __future__ import annotations

import os
import select
import socket

__all__ = ["Bell", "ring"]

MAX_PATH = 100  # sun_path holds 108 bytes on Linux, less elsewhere


class Bell:
    """A bound doorbell at ``path`` (OSError when it cannot be made)."""

    def __init__(self, path: str) -> None:
        if len(os.fsencode(path)) > MAX_PATH:
            raise OSError(f"{path} is too long for a Unix socket")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            # its directory (the transport's, 0700) keeps others out from the bind on; then 0600
            # (not a umask around bind(): the umask is the whole process's, other threads' too)
            sock.bind(path)
            os.chmod(path, 0o600)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.path = path
        self._sock: socket.socket | None = sock

    def wait(self, timeout: float) -> bool:
        """Until a ring (True, every ring so far consumed) or ``timeout`` seconds (False)."""
        sock = self._sock
        if sock is None:
            return False
        ready, _, _ = select.select([sock], [], [], max(0.0, timeout))
        if not ready:
            return False
        while True:
            try:
                sock.recv(64)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return True

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass


def ring(path: str) -> bool:
    """Ring the bell at ``path``; False when nobody listens there (never raises: a target
    that is gone or not yet there lists the transport on its own)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        sock.sendto(b"1", path)
        return True
    except OSError:  # absent, refused, or its queue full (a ring is pending already)
        return False
    finally:
        sock.close()
