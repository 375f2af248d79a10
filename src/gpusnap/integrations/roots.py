"""The Checkpointers of a process's trainer plug-ins: one per root, shared.

A root takes one writer at a time. Two plug-ins in one process (a second Trainer that resumes
where a crashed one stopped, in a notebook or a test) must not each open the same root, so
the plug-ins open roots here, noted per plug-in, and a root is closed when the last plug-in
using it lets it go (Lightning's ``teardown``, the end of a Hugging Face ``train``).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from gpusnap.checkpointer import Checkpointer

__all__ = ["acquire", "release"]


@dataclass(eq=False)
class _Root:
    checkpointer: Checkpointer
    settings: dict[str, Any]
    users: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)


_lock = threading.Lock()
_open: dict[str, _Root] = {}


def acquire(root: str, user: Any, **settings: Any) -> Checkpointer:
    """The writer of ``root`` for ``user``, opened on first use as ``Checkpointer(root,
    **settings)``; a root already open with other settings is a ValueError."""
    with _lock:
        entry = _open.get(root)
        if entry is None:
            # per process: Lightning saves from rank 0 alone under DDP, which a collective
            # Checkpointer (torch.distributed up) would wait on the other ranks for
            entry = _open[root] = _Root(Checkpointer(root, process_group=False, **settings), settings)
        elif entry.settings != settings:
            raise ValueError(f"{root} is open for another gpusnap plug-in of this process with other settings "
                             f"({entry.settings} here, {settings} asked): a root has one writer; close that "
                             "plug-in first (teardown(), close()), or give this one its own root")
        entry.users.add(user)
        return entry.checkpointer


def release(user: Any) -> None:
    """``user`` is done with its roots: close those no other plug-in uses (each waits for its
    saves); then raise the first error a close raised."""
    with _lock:
        closing = []
        for root, entry in list(_open.items()):
            if user in entry.users:  # (a root whose plug-ins were all dropped stays: exit closes it)
                entry.users.discard(user)
                if not entry.users:
                    closing.append(_open.pop(root).checkpointer)
    failure: BaseException | None = None
    for checkpointer in closing:
        try:
            checkpointer.close()
        except BaseException as exc:
            failure = failure or exc
    if failure is not None:
        raise failure
