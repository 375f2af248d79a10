"""Progress of the saves a block makes: each chunk stored tells a callback its bytes.

``gpusnap.import_`` drives its progress bar with it. The callback is taken when ``save()``
is called, on the caller's thread, and runs on the threads that store the chunks.

>>> told = []
>>> with reporting_progress(told.append):
...     callback() is not None
True
>>> callback() is None
True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

__all__ = ["callback", "reporting_progress"]

_told: ContextVar[Callable[[int], None] | None] = ContextVar("gpusnap_save_progress", default=None)


@contextmanager
def reporting_progress(told: Callable[[int], None]) -> Iterator[None]:
    """Saves made inside the block tell ``told(nbytes)`` as their chunks are stored."""
    token = _told.set(told)
    try:
        yield
    finally:
        _told.reset(token)


def callback() -> Callable[[int], None] | None:
    """The callback of the enclosing :func:`reporting_progress` block, if any."""
    return _told.get()
