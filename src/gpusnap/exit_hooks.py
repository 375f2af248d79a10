"""Saves pending at interpreter exit are finished, or reported on stderr.

Each live Checkpointer's save path (``save/saves.py``, kept alive by pending work; its
``at_exit(final)`` is ``save/lifecycle.py``'s) gets two calls:

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

SIGTERM (what SLURM, Kubernetes and spot instances send before they kill) ends a Python
process without ``atexit``. So the first Checkpointer made on the main thread installs a
handler, unless SIGTERM is ignored or ``Config.sigterm_grace_s`` is 0: it waits up to that
many seconds for each live Checkpointer's pending saves and promotions (``at_signal``, which
names on stderr what could not finish), then calls the handler it replaced, or, where that
was the default, ends the process with SIGTERM's own status. A handler the program installs
later replaces it (the program then owns SIGTERM; ``sys.exit`` from it runs the hooks above);
one that calls the handler it found (Lightning's does) gets the waiting, and decides itself
what follows.
"""

from __future__ import annotations

import atexit
import os
import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours)
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

__all__ = ["track"]


class _AtExit(Protocol):
    def at_exit(self, final: bool) -> None: ...

    def at_signal(self, deadline: float) -> None: ...


_live: weakref.WeakSet[_AtExit] = weakref.WeakSet()
_lock = threading.RLock()  # (re-entered by the SIGTERM handler on a main thread inside track())
_registered = False
_pid = os.getpid()  # the process whose Checkpointers these are
_grace_s = 0.0  # the longest Config.sigterm_grace_s of the Checkpointers tracked
_replaced: Any = None  # the SIGTERM handler ours replaced (None: ours is not installed)


def _forget_in_child() -> None:
    global _live
    _live = weakref.WeakSet()  # (the hooks inherited from the parent find nothing to do)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def track(owner: _AtExit, *, sigterm_grace_s: float = 0.0) -> None:
    """Call ``owner.at_exit`` at interpreter exit, and ``owner.at_signal`` on SIGTERM
    (given a grace), while ``owner`` is alive."""
    global _registered, _grace_s
    with _lock:
        _live.add(owner)
        _grace_s = max(_grace_s, sigterm_grace_s)
        if sigterm_grace_s > 0:
            _install_sigterm()
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


def _install_sigterm() -> None:
    global _replaced
    if _replaced is not None or threading.current_thread() is not threading.main_thread():
        return  # (installed already; or not on the main thread, where Python refuses it)
    try:
        current = signal.getsignal(signal.SIGTERM)
        if current is signal.SIG_IGN or current is None:  # ignored, or a handler not from Python
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # (a thread or platform that cannot install handlers)
        return
    _replaced = current


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    deadline = time.monotonic() + _grace_s
    _each_owner(lambda owner: owner.at_signal(deadline))
    if signal.getsignal(signum) is not _on_sigterm:
        return  # a handler the program installed later called this one: it decides what follows
    replaced = _replaced
    if callable(replaced):
        replaced(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)  # end as the default would have: by the signal
    os.kill(os.getpid(), signum)


def _run(final: bool) -> None:
    _each_owner(lambda owner: owner.at_exit(final))


def _each_owner(call: Callable[[_AtExit], None]) -> None:
    """``call`` each live owner of this process (in a forked child, such as a DataLoader
    worker, none: its parent's saves are not its own)."""
    if os.getpid() != _pid:
        return
    with _lock:
        owners = list(_live)
    for owner in owners:
        try:
            call(owner)
        except Exception:  # (it reports its own failures; one must not stop the others)
            traceback.print_exc()
