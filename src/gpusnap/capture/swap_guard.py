"""A storage about to be given other memory (``gpusnap.moving``: suspend and resume exchange
a storage's data pointer) during a tracked window: protect its span first, as for a resize.

A pending span of an open window is copied by address; once the storage's memory is
exchanged (and the old memory freed), the copier would read memory that is no longer the
state's. So before the exchange each open window with live spans protects the span of every
storage concerned, exactly as :mod:`gpusnap.capture.resize_guard` does before
``UntypedStorage.resize_`` (copy-on-write of the bytes not yet copied, else a wait until
they are): the checkpoint keeps the bytes as they were at ``save()``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from gpusnap.capture import resize_guard

__all__ = ["before_swap"]


def before_swap(storages: Iterable[torch.UntypedStorage]) -> None:
    """Protect, in every open window, the spans of ``storages`` (a no-op outside windows)."""
    windows = resize_guard._windows  # (replaced, never changed: read unlocked, as its wrapper does)
    if not windows:
        return
    storages = list(storages)
    for window in windows:
        for storage in storages:
            window.before_resize(storage)
