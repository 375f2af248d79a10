"""Manifests that exist but cannot be read: what they are, and whether one may be newer.

A corrupt, truncated or unreadable manifest is never a checkpoint (``list()``, ``latest()``
and ``restore()`` cannot use it), but it is never silently ignored either: the Checkpointer
warns about each one once, a restore records the newer ones it passed over, and
``gpusnap ls`` marks them.
"""

from __future__ import annotations

import calendar
import re
import time
from dataclasses import dataclass

__all__ = ["UnreadableManifest", "id_time", "may_be_newer"]

_STAMP = re.compile(r"^(\d{8}-\d{6})-(\d{3})-[0-9a-f]{6}(?:-\d+)?$")  # (-N: a distributed save's number)


def id_time(checkpoint_id: str) -> float | None:
    """The UTC time a ``Repository.new_id`` id was made at (millisecond precision), or None
    for an id of another form."""
    match = _STAMP.match(checkpoint_id)
    if match is None:
        return None
    try:
        seconds = calendar.timegm(time.strptime(match.group(1), "%Y%m%d-%H%M%S"))
    except ValueError:
        return None
    return seconds + int(match.group(2)) / 1000


@dataclass(frozen=True)
class UnreadableManifest:
    """``manifests/<id>.json`` that exists but fails to read, parse or match its checksum."""

    id: str  # the file name without ``.json``
    path: str  # full location, for messages
    reason: str  # the error, one line
    created: float | None  # from the id (``id_time``); None when the id does not say

    def as_dict(self) -> dict[str, object]:
        return {"id": self.id, "path": self.path, "reason": self.reason, "created": self.created}


def may_be_newer(entry: UnreadableManifest, than_id: str) -> bool:
    """Whether ``entry`` may be newer than checkpoint ``than_id``: ids made by ``new_id``
    sort by time; an id of another form could be anything, so it counts as newer."""
    if entry.created is None or id_time(than_id) is None:
        return True
    return entry.id > than_id
