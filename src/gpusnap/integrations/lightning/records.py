"""Which checkpoint a Lightning path names: the root's record of every save, then the file.

A pointer file is written after its checkpoint commits, so a crash between the two leaves a
committed checkpoint that its path does not name yet. The root is the truth: every save
carries a tag made from its path (:func:`tag_for`: ``last.ckpt@<random>``, relative to the
directory that holds the root), and :func:`resolve_file` answers with the newest committed
checkpoint recorded for the path that is not older than what the file itself names (a
pointer's checkpoint, a placeholder's time). A copy of a pointer (no save recorded under its
own name) names what it names.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable

from gpusnap.config import Config
from gpusnap.errors import CheckpointNotFoundError
from gpusnap.storage.repository import Repository
from gpusnap.storage.unreadable import id_time

from .pointer import Placeholder, Pointer, manifest_link, read_pointer

__all__ = ["recorded_for", "resolve_file", "tag_for"]

_SEP = "@"  # between the path and the part that makes each tag unique (a tag names one checkpoint)


def _key(path: str, root: str) -> str:
    """``path`` relative to the directory holding ``root``, as a tag may spell it (no ``/``)."""
    # directories as they really are (a pointer read through a link names its root that way);
    # the file's own name kept: a link's saves are recorded under the link's name
    here = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
    relative = os.path.relpath(here, os.path.realpath(os.path.dirname(os.path.abspath(root))))
    return relative.replace("%", "%25").replace(os.sep, "%2F")


def tag_for(path: str, root: str) -> str:
    """A new tag recording that a checkpoint in ``root`` was saved for ``path``."""
    return f"{_key(path, root)}{_SEP}{secrets.token_hex(8)}"


def recorded_for(path: str, root: str, checkpoints: Iterable[tuple[str, str | None, float]]) -> list[tuple[float, str]]:
    """``(created, id)`` of the ``(id, tag, created)`` saved for ``path``, oldest first."""
    key = _key(path, root)
    return sorted((created, cid) for cid, tag, created in checkpoints
                  if tag is not None and tag.rpartition(_SEP)[0] == key)


def resolve_file(path: str, config: Config | None = None) -> Pointer | None:
    """The checkpoint ``path`` names (absolute, local); None for a file that is not a gpusnap
    pointer. FileNotFoundError when nothing is there; CheckpointNotFoundError when neither the
    file nor the root's record leads to a committed checkpoint."""
    found = read_pointer(path)  # (through a link: the target's root and checkpoint)
    if found is None:
        return None
    try:
        committed = {m.id: m for m in Repository.open(found.root, config=config).list()}
    except CheckpointNotFoundError:
        committed = {}
    saves = [(m.id, m.tag, m.created) for m in committed.values()]
    named = committed.get(found.checkpoint) if isinstance(found, Pointer) else None
    floor = _floor(found, named.created if named is not None else None)
    # the file's own saves (a link's target's: ModelCheckpoint links last.ckpt to a top-k file)
    choices = [(c, i) for c, i in recorded_for(os.path.realpath(path), found.root, saves) if c >= floor]
    if named is not None:
        choices.append((named.created, named.id))
    if os.path.islink(path):  # saves of the link's own name since it was made, not yet replacing it
        linked = os.lstat(path).st_mtime
        choices += [(c, i) for c, i in recorded_for(path, found.root, saves) if c >= linked]
    if choices:
        return Pointer(found.root, max(choices)[1])
    if isinstance(found, Placeholder) or manifest_link(path) is not None:  # (a first save, not committed)
        raise CheckpointNotFoundError(
            f"{path}: no checkpoint is committed for it yet (its first one is still being saved, or the "
            "process saving it stopped first): once that process is gone, delete the file to start from the "
            "beginning, or load another checkpoint")
    raise CheckpointNotFoundError(f"{path} names checkpoint {found.checkpoint}, which is not in {found.root} "
                                  "(deleted since?)")


def _floor(found: Pointer | Placeholder, created: float | None) -> float:
    """How old a checkpoint recorded for the path may be and still count: not older than
    the one the file names (a missing one: its id's time, to the millisecond it keeps)."""
    if isinstance(found, Placeholder):
        return found.since
    if created is not None:
        return created
    made = id_time(found.checkpoint)
    return float("-inf") if made is None else made - 1e-3
