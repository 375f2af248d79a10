"""Failed saves whose error the program has not seen yet: raised once, or reported at exit.

A save fails on a background thread. Its :class:`~gpusnap.handles.SaveCompletion` holds the error, but
a program that never asks that handle would lose the checkpoint without a word. So every
failure is also recorded here; the Checkpointer's next ``wait()``, ``close()`` or
``with``-block exit takes what nothing has observed yet (``gpusnap.handles.SaveCompletion.claim``: once, from
whichever thread comes first) and raises it, and the exit hooks print it on stderr.
"""

from __future__ import annotations

import sys
import threading
from typing import TextIO

from gpusnap.handles import SaveCompletion

__all__ = ["Unobserved", "add_note"]


class Unobserved:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failed: list[SaveCompletion] = []

    def add(self, pending: SaveCompletion) -> None:
        with self._lock:
            # the ones observed meanwhile are done with (a loop that waits on each save keeps
            # this list short)
            self._failed = [p for p in self._failed if not p.observed()]
            self._failed.append(pending)

    def take(self) -> list[SaveCompletion]:
        """The failed saves nothing has observed yet, oldest first; they count as observed now."""
        with self._lock:
            failed, self._failed = self._failed, []
        return [p for p in failed if p.claim()]

    def raise_if_any(self, where: str) -> None:
        """Raise the oldest unobserved failure itself (its type is the caller's to catch),
        with a note saying where it surfaced and naming every other one."""
        failed = self.take()
        if not failed:
            return
        first = failed[0].error()
        assert first is not None
        add_note(first, f"gpusnap: raised by {where}: checkpoint {failed[0].id} had failed "
                        "and nothing had observed its error yet")
        for p in failed[1:]:
            add_note(first, f"gpusnap: checkpoint {p.id} failed too: {describe(p)}")
        raise first

    def note_on(self, error: BaseException, where: str) -> None:
        """Name every unobserved failure in a note on ``error``, which is already propagating
        (a ``with`` block's own exception is never replaced by a save's)."""
        for p in self.take():
            add_note(error, f"gpusnap: {where}: checkpoint {p.id} failed too: {describe(p)}")

    def report(self, root: str, out: TextIO | None = None) -> None:
        """Print every unobserved failure (interpreter exit: nobody is left to raise it to)."""
        out = out if out is not None else sys.stderr
        for p in self.take():
            print(f"gpusnap: checkpoint {p.id} under {root} failed and nothing observed its error "
                  f"(no wait(), close() or with block after it): {describe(p)}", file=out, flush=True)


def describe(pending: SaveCompletion) -> str:
    error = pending.error()
    return f"{type(error).__name__}: {error}"


def add_note(error: BaseException, note: str) -> None:
    add = getattr(error, "add_note", None)  # Python >= 3.11; tracebacks print the notes
    if add is not None:
        add(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", ()), note]  # type: ignore[attr-defined]
