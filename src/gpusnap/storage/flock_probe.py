"""Whether a live process holds a file's flock, and taking one without waiting: the kernel
drops a dead process's flock, so a holder SIGKILLed reads as gone (a root's writer lease, a
migration's two sides)."""

from __future__ import annotations

import fcntl
import os

__all__ = ["flock_held", "try_flock"]


def try_flock(fd: int, *, shared: bool = False) -> bool:
    """Take ``fd``'s flock (exclusive, or ``shared``) if it is free now; False if it is held."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def flock_held(path: str, *, follow_links: bool = True) -> bool:
    """Whether a live process holds ``path``'s flock. A probe: it takes the lock for an
    instant when it is free, so ask only about a holder known to have taken it.
    ``follow_links=False``: a symbolic link at ``path`` is an error (ELOOP), not followed."""
    flags = os.O_RDWR | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return False
    try:
        if not try_flock(fd):
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)
