"""Every lazy restore of the process: what saves wait for, what the doors gate, what is stale.

A restore from one root into tensors that are then checkpointed to another (restore from a
base run, checkpoint to this run: a common layout) goes through two Checkpointers, so the
wait cannot be a Checkpointer's own: every save, of any Checkpointer on any thread, calls
:func:`before_save` first. Call order (``LazyRestore`` makes the calls, on the threads named)::

    begin(session)       restoring thread, before its loader starts: saves wait for it; the
                         doors (``restore.lazy.doors``) are installed with the first live gate
    gate_done(session)   copy thread, everything loaded: the doors go with the last live gate
    settled(session, ..) once the load is over and restore() has returned: its targets hold
                         restored bytes, or (it failed) the ones it never loaded are *stale*
    end(session)         retired (its Checkpointer restores again, or restore() raised)
    restored(tensors)    an eager restore wrote these in full: stale no more

A restore of any Checkpointer first waits for every lazy restore still loading
(:func:`wait_for_loads`): two loads into the same tensors must not interleave.

A stale storage stays stale until a later restore (lazy or eager, any Checkpointer) writes
it in full, or it is freed (held by a weak reference). A save refuses only if what it would
commit holds one: a failed restore into one model does not block saving another.

A fork (``fork_safety``) waits like a save, on the forking thread, until no lazy restore is
loading, and holds this module's lock across the fork so that none begins meanwhile: the
child has none of a loader's threads, and reads restored bytes (a DataLoader worker).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from gpusnap import fork_safety
from gpusnap.errors import CheckpointError
from gpusnap.restore.lazy import doors
from gpusnap.restore.lazy.gate import looking_past_failures, storage_key, storage_of

if TYPE_CHECKING:
    from gpusnap.restore.lazy.lazy_restore import LazyRestore

__all__ = [
    "before_save", "begin", "end", "gate_done", "live", "quiesce_for_fork", "restored", "retire_failed", "settled", "track",
    "wait_for_loads",
]


@dataclass(frozen=True)
class _Stale:
    ref: StorageWeakRef
    path: str  # the key path the failed restore would have filled
    checkpoint_id: str
    error: BaseException


_lock = threading.Lock()
_sessions: list[LazyRestore] = []  # begun, not over: a save waits for them
_live: tuple[LazyRestore, ...] = ()  # gates still gating (loading, or failed and not retired); read unlocked
_stale: dict[int, _Stale] = {}  # storage key -> why its bytes are not what the program believes
_restorers: weakref.WeakSet[Any] = weakref.WeakSet()  # Restorers whose finished gates a save pops


def track(restorer: Any) -> None:
    """``restorer.reap()`` runs at every save (it pops finished gates on the saving thread)."""
    with _lock:
        _restorers.add(restorer)


def live() -> tuple[LazyRestore, ...]:
    return _live


def begin(session: LazyRestore) -> None:
    with _lock:
        _sessions.append(session)
        _set_live(_live + (session,))


def gate_done(session: LazyRestore) -> None:
    with _lock:
        _set_live(tuple(s for s in _live if s is not session))


def end(session: LazyRestore) -> None:
    with _lock:
        if session in _sessions:
            _sessions.remove(session)
        _set_live(tuple(s for s in _live if s is not session))


def settled(
    session: LazyRestore,
    *,
    restored_targets: Iterable[torch.Tensor],
    stale_targets: Iterable[tuple[torch.Tensor, str]],
    error: BaseException | None,
) -> None:
    """The load is over and restore() returned: record what the targets now hold."""
    restored(restored_targets)
    with _lock:
        if error is not None:
            for tensor, path in stale_targets:
                storage = storage_of(tensor)
                if storage is not None:
                    _stale[storage._cdata] = _Stale(StorageWeakRef(storage), path, session.handle.checkpoint_id,
                                                    error)
        if session in _sessions:
            _sessions.remove(session)


def restored(tensors: Iterable[torch.Tensor]) -> None:
    """These tensors hold a checkpoint's bytes in full now."""
    with _lock:
        if not _stale:
            return
        for t in tensors:
            _stale.pop(storage_key(t), None)  # type: ignore[arg-type]


def before_save(app_state: Mapping[str, Any]) -> None:
    """Before a save's consistent point, on the saving thread: wait until no lazy restore in
    the process is loading; then refuse (``CheckpointError``) if ``app_state`` holds a tensor
    a failed lazy restore never loaded. Pops finished gates of this thread."""
    wait_for_loads()
    for restorer in list(_restorers):
        restorer.reap()
    _refuse_stale(app_state)


def wait_for_loads() -> None:
    """Until no lazy restore in the process is loading (and each one's outcome is recorded)."""
    while True:
        with _lock:
            waiting = [s for s in _sessions if not s.over()]
        if not waiting:
            return
        for session in waiting:
            session.wait_over()


def retire_failed() -> None:
    """Before a restore writes: stop every failed lazy restore's gate (any Checkpointer's).
    Its never-loaded tensors stay recorded as stale (saves of them are refused until a
    restore rewrites them), but a restore into them, from any root, must not be refused by
    the failed one's gate, which only its own Checkpointer's next restore used to retire."""
    with _lock:
        failed = [s for s in _live if s.over() and s.loader.error is not None]
    for session in failed:
        session.retire()


def _refuse_stale(app_state: Mapping[str, Any]) -> None:
    with _lock:
        for key in [k for k, s in _stale.items() if s.ref.expired()]:
            del _stale[key]
        if not _stale:
            return
        stale = dict(_stale)
    from gpusnap.state.flatten import flatten  # (only here: a failed restore is rare)

    try:
        with looking_past_failures():  # the state_dict() calls reach the never-loaded tensors
            flat = flatten(app_state, allow_pickle=True)
    except CheckpointError:
        return  # not storable: the save's own flatten says why
    for span in flat.spans:
        found = stale.get(span.storage._cdata)
        if found is not None and not found.ref.expired():
            what = ", ".join(span.paths[:3]) or found.path
            raise CheckpointError(
                f"{what}: the lazy restore of {found.checkpoint_id} failed before loading it ({found.path}), so it "
                f"holds stale bytes; restore again before saving. The failure: {found.error}"
            ) from found.error


def _set_live(sessions: tuple[LazyRestore, ...]) -> None:
    """(Under _lock.) The doors are wrapped exactly while some gate is live."""
    global _live
    _live = sessions
    if sessions:
        doors.install(_HOOKS)
    else:
        doors.uninstall()


def _wait_for(tensor: torch.Tensor) -> None:
    sessions = _live
    if sessions and not doors.exempt():
        for session in sessions:
            session.gate.before_op((tensor,))


def _wait_for_storage(storage: torch.UntypedStorage) -> None:
    sessions = _live
    if sessions and not doors.exempt():
        for session in sessions:
            session.gate.before_storage(storage)


def _rearm() -> None:
    for session in _live:
        session.rearm()


_HOOKS = doors.DoorHooks(wait_for=_wait_for, wait_for_storage=_wait_for_storage, rearm=_rearm)

_forking = threading.local()  # held: this thread holds _lock across its fork


def quiesce_for_fork() -> None:
    """Before a fork, on the forking thread: until every lazy restore of the process is
    quiet (``LazyRestore.quiet``), then take the lock until the fork is done. gpusnap's own
    threads do not wait (a loader's would wait for itself): the child fails what they leave
    loading (``LazyRestore.after_fork_in_child``)."""
    if not doors.exempt():
        while True:
            with _lock:
                loading = [s for s in _sessions if not s.quiet()]
            for session in loading:
                session.quiesce()
            _lock.acquire()
            if all(s.quiet() for s in _sessions):
                break
            _lock.release()  # one began meanwhile
    else:
        _lock.acquire()
    _forking.held = True


def _after_fork_in_parent() -> None:
    if getattr(_forking, "held", False):
        _forking.held = False
        _lock.release()


def _after_fork_in_child() -> None:
    global _lock
    _forking.held = False
    _lock = threading.Lock()
    for session in dict.fromkeys((*_sessions, *_live)):  # (each once; the list may change)
        session.after_fork_in_child()


fork_safety.at_fork(before=quiesce_for_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
