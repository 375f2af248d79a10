"""Storage resizes during a tracked window: protect the span first, as for a write.

``UntypedStorage.resize_`` (FSDP frees its unsharded parameters with ``resize_(0)``, and
grows them back the same way) never reaches the dispatcher, so the tracker cannot see it
(measured on torch 2.13: a dispatch mode sees nothing). Yet a shrink frees the bytes that a
pending span still has to copy, and a growth moves them: the copier, which reads a live span
by address, would read freed memory (a crash on the CPU, where its copies run on its own
thread; stale or foreign bytes on CUDA). So while a window with live spans is open,
``UntypedStorage.resize_`` is wrapped: before the resize runs, each open window protects the
span of that storage (:meth:`CaptureWindow.before_resize`: copy-on-write of the bytes not yet
copied, else a wait until they are), under the window's lock, which the copier holds while
it reads a piece. The checkpoint then holds the bytes as they were at ``save()``, and the
program's storage is resized as asked. ``TypedStorage.resize_`` and FSDP's
``_typed_storage()._resize_`` call the same method. Outside windows nothing is wrapped.

Resizes that bypass the method (C++ code calling the storage's ``set_nbytes`` or the
allocator directly) stay unseen: the copier checks each live storage's size under the lock
before every piece and fails the save naming the tensor (docs/capture.md says what is left).
The wrapper goes in when ``save()`` starts the window, after its snapshot: a resize by
another thread while ``save()`` itself runs is a race with the consistent point, like any
write from another thread then (docs/guarantees.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from gpusnap import fork_safety

if TYPE_CHECKING:
    from gpusnap.capture.window import CaptureWindow

__all__ = ["unwatch", "watch"]

_lock = threading.Lock()
_windows: tuple[CaptureWindow, ...] = ()  # replaced, never changed: the wrapper reads it unlocked
_original: Callable[..., Any] = torch.UntypedStorage.resize_  # (torch._C.StorageBase's)
_MISSING = object()
_own: Any = _MISSING  # what UntypedStorage's own __dict__ held before the wrapper went in


def watch(window: CaptureWindow) -> None:
    """Protect ``window``'s spans from resizes until :func:`unwatch`."""
    global _windows, _original, _own
    with _lock:
        if not _windows:
            _own = torch.UntypedStorage.__dict__.get("resize_", _MISSING)
            _original = torch.UntypedStorage.resize_
            torch.UntypedStorage.resize_ = _resize_  # type: ignore[method-assign]
        _windows = (*_windows, window)


def unwatch(window: CaptureWindow) -> None:
    """Stop protecting ``window``; the last one puts ``UntypedStorage.resize_`` back."""
    global _windows
    with _lock:
        if window not in _windows:
            return
        _windows = tuple(w for w in _windows if w is not window)
        if not _windows and torch.UntypedStorage.__dict__.get("resize_") is _resize_:
            if _own is _MISSING:
                del torch.UntypedStorage.resize_  # inherited from torch._C.StorageBase again
            else:
                torch.UntypedStorage.resize_ = _own  # type: ignore[method-assign]


def _new_lock_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # (the copier may have held it at the fork: the child's window closes unwatch)


fork_safety.at_fork(after_in_child=_new_lock_in_child)


def _resize_(self: torch.UntypedStorage, size: int) -> Any:
    for window in _windows:
        window.before_resize(self)  # never raises for gpusnap's sake (see before_resize)
    return _original(self, size)
