"""Saves pending at interpreter exit are finished, or reported on stderr.

Each live Checkpointer gets two calls of ``_at_exit(final)``:

* ``final=False``, *before* ``concurrent.futures`` stops its thread pools: the pending saves
  are finished while the pools that store them (gpusnap's own, and a storage backend's) still
  take work. CPython stops them from ``threading._shutdown``, which runs before any ``atexit``
  callback: a save still in flight at ``atexit`` time failed with "cannot schedule new futures
  after interpreter shutdown". The only hook that runs earlier is
  ``threading._register_atexit`` (CPython-private, 3.9+; callbacks run last-registered first,
  so this module imports ``concurrent.futures.thread`` before registering). This is gpusnap's
  one reliance on it: without it only the second call runs, and a save still in flight then
  fails and is reported.
* ``final=True``, from ``atexit`` (after the program's non-daemon threads have ended):
  ``close()``, so that saves started meanwhile finish too (or fail) and are reported.
"""

from __future__ import annotations

import atexit
import os
import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours)
import threading
import traceback
import weakref
from typing import Protocol

__all__ = ["track"]


class _AtExit(Protocol):
    def _at_exit(self, final: bool) -> None: ...


_live: weakref.WeakSet[_AtExit] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False
_pid = os.getpid()  # the process whose Checkpointers these are


def _forget_in_child() -> None:
    global _live
    _live = weakref.WeakSet()  # (the hooks inherited from the parent find nothing to do)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def track(owner: _AtExit) -> None:
    """Call ``owner._at_exit`` at interpreter exit while ``owner`` is alive."""
    global _registered
    with _lock:
        _live.add(owner)
        if _registered:
            return
        _registered = True
    atexit.register(_run, True)
    early = getattr(threading, "_register_atexit", None)
    if early is not None:
        try:
            early(_run, False)
        except RuntimeError:  # the interpreter is already shutting down: atexit only
            pass


def _run(final: bool) -> None:
    if os.getpid() != _pid:
        return  # a forked child (a DataLoader worker): its parent's saves are not its own
    with _lock:
        owners = list(_live)
    for owner in owners:
        try:
            owner._at_exit(final)
        except Exception:  # (it reports its own failures; one must not stop the others)
            traceback.print_exc()
