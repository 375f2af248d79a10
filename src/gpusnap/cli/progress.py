"""Progress bars on long operations, only when stdout is a terminal."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

__all__ = ["byte_progress", "sized_progress"]


@contextmanager
def byte_progress(total: int, label: str) -> Iterator[Callable[[int], None]]:
    """Yields ``advance(nbytes)``; draws a rich progress bar on a terminal, nothing otherwise."""
    if not sys.stdout.isatty() or total <= 0:
        yield lambda n: None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    # (stderr left alone: a warning logged meanwhile stays on stderr, not on the bar's stdout)
    with Progress("[progress.description]{task.description}", *columns, transient=True,
                  redirect_stderr=False) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


@contextmanager
def sized_progress(label: str) -> Iterator[Callable[[int], Callable[[int], None]]]:
    """Yields ``start(total) -> advance``, the ``progress`` argument of export, import and gc:
    they know their total only once they have read their input, so the bar (of
    :func:`byte_progress`) opens then and closes when this block ends. A second ``start``
    (gc of each rank's root in turn) closes the bar before: one live display at a time."""
    with ExitStack() as stack:

        def start(total: int) -> Callable[[int], None]:
            stack.close()
            return stack.enter_context(byte_progress(total, label))

        yield start
