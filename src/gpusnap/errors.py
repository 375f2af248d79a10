"""Errors raised by gpusnap. Every one derives from :class:`CheckpointError`."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "IntegrityError",
    "ValidationError",
    "RestoreMismatchError",
    "CheckpointNotFoundError",
    "StorageError",
]


class CheckpointError(RuntimeError):
    """Base class: a checkpoint could not be written, read or applied."""


class IntegrityError(CheckpointError):
    """Stored bytes do not match their hash (corruption or truncation)."""


class ValidationError(CheckpointError):
    """A write the tracker did not see changed captured state; nothing was committed."""


class RestoreMismatchError(CheckpointError):
    """The restore target does not fit the checkpoint (keys, shapes, dtypes)."""


class CheckpointNotFoundError(CheckpointError, LookupError):
    """No committed checkpoint matches the requested id or tag, or the root is missing."""


class StorageError(CheckpointError):
    """The storage backend failed (full disk, permissions, a lock held elsewhere)."""


class SaveSkipped(CheckpointError):
    """``Config.when_busy="skip"``: the fast tier had no room for this save when it was
    made (the previous save still copying, or its slabs full), so nothing was saved. Raised
    by that save's ``wait()`` only: a skip is reported, not a failure the Checkpointer raises."""
