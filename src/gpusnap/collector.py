"""Python's cyclic garbage collector held off while ``save()`` runs on the program's thread.

``save()`` makes thousands of short-lived objects for a model of a few thousand tensors
(views, tree nodes, span records). Each 700 of them start a young collection, and every so
often one becomes a full collection of the whole heap: 30-200 ms in a training process, on
the program's thread, at the moment the GPU waits for it (BENCHMARKS.md).
Paused, the collections still run, at the program's next allocations, usually while its
kernels keep the GPU busy.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Disable the collector for the block if it was enabled, then enable it again.

    A collector already disabled (by the program) is left alone. Two threads inside at once:
    the first to leave enables it; the second may then collect, which costs time, not
    correctness.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
