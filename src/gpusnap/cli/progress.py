"""Progress bars on long operations, only when stdout is a terminal.

Bytes are shown in binary units (KiB, MiB, GiB), as every summary line of the CLI shows them
(``render.human_bytes``): a bar that ended in "MB" above a summary in "MiB" read as two numbers.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

from gpusnap.cli.render import human_bytes

__all__ = ["byte_progress", "sized_progress", "told_progress"]


@contextmanager
def byte_progress(total: int, label: str) -> Iterator[Callable[[int], None]]:
    """Yields ``advance(nbytes)``; draws a rich progress bar on a terminal, nothing otherwise."""
    if not sys.stdout.isatty() or total <= 0:
        yield lambda n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, ProgressColumn, Task, TimeRemainingColumn
    from rich.text import Text

    class Speed(ProgressColumn):
        def render(self, task: Task) -> Text:
            speed = task.finished_speed or task.speed
            return Text("?" if speed is None else f"{human_bytes(speed)}/s", style="progress.data.speed")

    columns = (BarColumn(), DownloadColumn(binary_units=True), Speed(), TimeRemainingColumn())
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


@contextmanager
def told_progress(label: str) -> Iterator[tuple[Callable[[int], None], Callable[[int], None]]]:
    """Yields ``(on_total, advance)`` for an operation that is told its total and each byte
    count through two callbacks (``Repository.verify``): ``on_total`` opens the bar of
    :func:`sized_progress`, so it ends full when the counts add up to that total."""
    with sized_progress(label) as start:
        opened: list[Callable[[int], None]] = []
        yield (lambda total: opened.append(start(total))), (lambda n: opened[-1](n) if opened else None)
