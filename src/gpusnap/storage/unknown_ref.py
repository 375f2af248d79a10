"""What a lookup of a checkpoint that is not there says: the tags and ids that are there
(people ask for tags, so listing ids alone does not help), and whether retention deleted the
one asked for, when this process's retention did.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from gpusnap.errors import CheckpointNotFoundError
from gpusnap.storage.manifest import Manifest

__all__ = ["Retired", "unknown_ref"]

REMEMBERED = 4096  # ids and tags: a job may save every step for days, so the record is bounded
SHOWN = 5  # tags and ids named in the message (the newest)


class Retired:
    """The ids and tags of checkpoints retention deleted through one Repository object, with
    the ``keep_last`` that dropped each (the newest :data:`REMEMBERED` names)."""

    def __init__(self) -> None:
        self._keep_last: OrderedDict[str, int] = OrderedDict()
        self._mutex = threading.Lock()

    def note(self, manifest: Manifest, keep_last: int) -> None:
        with self._mutex:
            for name in (manifest.id, manifest.tag):
                if name:
                    self._keep_last[name] = keep_last
                    self._keep_last.move_to_end(name)
            while len(self._keep_last) > REMEMBERED:
                self._keep_last.popitem(last=False)

    def keep_last(self, ref: str) -> int | None:
        """The ``keep_last`` that deleted ``ref`` (an id or a tag), or None if it did not."""
        with self._mutex:
            return self._keep_last.get(ref)


def unknown_ref(
    ref: str, root: str, manifests: Sequence[Manifest], retired: Retired, note: str = ""
) -> CheckpointNotFoundError:
    """The error for ``ref``, neither an id nor a tag of ``manifests`` (oldest first)."""
    keep_last = retired.keep_last(ref)
    why = (f": retention deleted it (keep_last={keep_last} keeps the {keep_last} newest)"
           if keep_last is not None else "")
    tags = [m.tag for m in manifests if m.tag]
    return CheckpointNotFoundError(
        f"no checkpoint with id or tag {ref!r} in {root}{why}; "
        f"tags: {_newest(tags)}; newest ids: {_newest([m.id for m in manifests])}{note}"
    )


def _newest(names: Sequence[str]) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[-SHOWN:])
    return shown if len(names) <= SHOWN else f"{shown} (and {len(names) - SHOWN} older)"
