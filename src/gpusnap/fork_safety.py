"""What a forked child inherits from gpusnap: no thread, so nothing that waits for one.

``os.fork()`` copies the calling thread only. A lazy restore's gate and a capture window's
tracker live on in the child (on its one thread's dispatch-mode stack, in class-level
wrappers), but the loader and copier threads they wait for do not, and a lock that one of
those threads held at the fork stays held there for good. Each module with such state
registers its hooks here; :func:`at_fork` puts them behind one ``os.register_at_fork``.

Call order around every ``os.fork()`` (and every fork of ``multiprocessing``'s "fork"
context: a DataLoader's workers)::

    before            on the forking thread, last registered first (may wait, then take
                      locks that no other thread may hold at the fork)
    after_in_parent   first registered first (releases what ``before`` took)
    after_in_child    first registered first, on the child's only thread

(os.register_at_fork's own order: a module registers after the modules it imports, so in
the child the layers below are usable again before the hooks above them run.)

What the hooks do (docs/guarantees.md, "What a fork child sees"):

- ``restore.active``: before the fork, every lazy restore of the process finishes loading
  (bounded by the load only): a DataLoader worker then reads restored bytes, never the ones
  from before the restore, and no gate in the child waits. Its lock is held across the fork,
  so no restore begins meanwhile; a load still going in the child (a fork from one of
  gpusnap's own threads, which never wait) fails there with an error that says so.
- ``capture.window``: in the child every inherited capture window is closed: the child's
  writes reach only its own copy of memory, never the parent's checkpoint, and wait for no
  copy. Its lock is a new one (the copier may have held the old one at the fork).
- ``launch_hooks``: a new lock in the child.
- ``capture.warmup``: a new lock, and no kernel warm-up running, in the child.
- ``storage.backend``: the child lets go of the writer leases it inherited (without unlocking
  the parent's), as ``migrate.transport`` does of a migration's locks.

A hook must not raise; one that does is logged, and the others still run (a fork cannot be
undone half way).

A fork that Python does not see (an extension calling ``fork()`` in C,
``subprocess`` without ``preexec_fn``, which execs at once) runs no hook: its child must not
use torch state gpusnap is gating or capturing.
"""

from __future__ import annotations

# Libraries whose own before-fork hooks take a lock a loader thread may need (a log record,
# a thread pool's submit) must register before this module: os.register_at_fork runs the
# last registered first, so they then take their locks only once our waits are over.
import concurrent.futures.thread  # noqa: F401  (imported for its fork hook, see above)
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["at_fork"]

log = logging.getLogger("gpusnap")

Hook = Callable[[], None]


@dataclass(frozen=True)
class _Hooks:
    before: Hook | None
    after_in_parent: Hook | None
    after_in_child: Hook | None


_hooks: list[_Hooks] = []  # replaced, never changed in place: a fork reads it unlocked
_lock = threading.Lock()


def at_fork(*, before: Hook | None = None, after_in_parent: Hook | None = None,
            after_in_child: Hook | None = None) -> None:
    """Run these around every fork Python makes, in the order the module docstring gives."""
    global _hooks
    with _lock:
        _hooks = [*_hooks, _Hooks(before, after_in_parent, after_in_child)]


def _run(hooks: list[Hook | None], when: str) -> None:
    for hook in hooks:
        if hook is None:
            continue
        try:
            hook()
        except Exception:  # (the fork goes on whatever happens: the others must still run)
            log.exception("gpusnap: a %s-fork hook failed", when)


def _before() -> None:
    _run([h.before for h in reversed(_hooks)], "before")


def _after_in_parent() -> None:
    _run([h.after_in_parent for h in _hooks], "after")


def _after_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # (at_fork on another thread of the parent may have held it)
    _run([h.after_in_child for h in _hooks], "after")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before, after_in_parent=_after_in_parent, after_in_child=_after_in_child)
