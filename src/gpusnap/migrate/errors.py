"""The error a live migration raises when it cannot go on."""

from __future__ import annotations

from gpusnap.errors import CheckpointError

__all__ = ["MigrationError"]


class MigrationError(CheckpointError):
    """A live migration failed: the message says which side, why, and what ``app_state``
    holds now (on the target: untouched, or one complete round of the source's state, or
    partly written; on the source: always its own, as the program left it).

    >>> isinstance(MigrationError("the source ended before handing off"), CheckpointError)
    True
    """
