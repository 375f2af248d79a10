"""The error of import and export: a file that is not what it should be."""

from __future__ import annotations

from gpusnap.errors import CheckpointError

__all__ = ["FormatError", "reason"]


class FormatError(CheckpointError, ValueError):
    """A file or directory to import is corrupt, truncated or of no supported format, or a
    checkpoint cannot be written in the format asked for. The message starts with the path
    and says what is wrong (the CLI prints it as its one error line, exit status 2)."""


def reason(exc: BaseException) -> str:
    """``exc`` as one short line for a FormatError: its first sentence, whitespace folded
    (the libraries read here explain at length, over several lines)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    head, dot, _ = text.partition(". ")
    return head + ("." if dot else "")
