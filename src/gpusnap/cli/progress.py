"""Progress bars on long operations, only when stdout is a terminal."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["byte_progress"]


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
    with Progress("[progress.description]{task.description}", *columns, transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)
