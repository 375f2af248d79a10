"""The storages suspended in this process, and who holds their host bytes.

A suspended storage's data pointer is the host copy's address (``moving.swap``): that memory
must live as long as the storage points at it, whatever happens to the ``Suspended`` handle.
So the registry, not the handle, keeps each suspension (its *holder*) alive until every
storage of it is resumed or gone: once no tensor holds a storage, its bytes are wanted by no
one. Storages are held weakly; :func:`sweep` releases the holders left with none.

It also answers "is this storage suspended already?" for a second ``suspend`` of the same
state, by storage identity (``_cdata``) confirmed through the weak reference (a freed
StorageImpl's address may be reused).
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["Holder", "add", "holder_of", "remove", "sweep"]


class Holder(Protocol):
    """What owns a suspension's host bytes (``suspended.Core``)."""

    def release(self) -> None:
        """Let go of the host bytes: no storage points at them any more. Idempotent."""
        ...


_lock = threading.Lock()
_by_key: dict[int, tuple[StorageWeakRef, Holder]] = {}  # storage key -> (its weak ref, holder)
_holders: list[Holder] = []  # every holder with a storage still suspended


def add(holder: Holder, storages: list[torch.UntypedStorage]) -> None:
    with _lock:
        for storage in storages:
            _by_key[storage._cdata] = (StorageWeakRef(storage), holder)
        if not any(h is holder for h in _holders):
            _holders.append(holder)


def remove(holder: Holder, storages: list[torch.UntypedStorage]) -> bool:
    """These storages of ``holder`` are resumed; True when it has none suspended left (it
    is then no longer held here: releasing its host bytes is the caller's)."""
    with _lock:
        for storage in storages:
            found = _by_key.get(storage._cdata)
            if found is not None and found[1] is holder:
                del _by_key[storage._cdata]
        for key in [k for k, (ref, h) in _by_key.items() if h is holder and ref.expired()]:
            del _by_key[key]  # (dropped by the program: nothing to resume there)
        if any(h is holder for _, h in _by_key.values()):
            return False
        _holders[:] = [h for h in _holders if h is not holder]
        return True


def holder_of(storage: torch.UntypedStorage) -> Holder | None:
    """The suspension ``storage`` belongs to, if it is suspended."""
    with _lock:
        found = _by_key.get(storage._cdata)
    if found is None or found[0].expired():
        return None
    return found[1]


def sweep() -> int:
    """Release the holders none of whose suspended storages is alive any more (the program
    dropped the tensors without resuming them); returns how many."""
    with _lock:
        for key in [k for k, (ref, _) in _by_key.items() if ref.expired()]:
            del _by_key[key]
        live = {id(h) for _, h in _by_key.values()}
        done = [h for h in _holders if id(h) not in live]
        _holders[:] = [h for h in _holders if id(h) in live]
    for holder in done:
        holder.release()
    return len(done)
