"""Pointer files: what a Lightning checkpoint path holds when gpusnap stored the checkpoint.

Lightning treats a checkpoint as one file at a path: ``ModelCheckpoint`` checks that it
exists, sorts ``last*.ckpt`` by modification time, links or deletes it. So the path gets a
small JSON document naming the gpusnap root and checkpoint id; the state itself lives in the
root, where checkpoints share their unchanged chunks. A pointer is written (atomically: a
temporary name, fsync, rename) only once its checkpoint is committed, so every pointer on
disk names a complete checkpoint, whatever moment a crash picks.

The root is recorded relative to the pointer's directory, so a checkpoint directory that holds
its root (the default ``.gpusnap``) can be moved or copied whole.

>>> import tempfile, os
>>> d = tempfile.mkdtemp()
>>> write_pointer(os.path.join(d, "last.ckpt"), Pointer(os.path.join(d, ".gpusnap"), "20260101-000000-abcd"))
>>> p = read_pointer(os.path.join(d, "last.ckpt"))
>>> p.checkpoint, p.root == os.path.join(d, ".gpusnap")
('20260101-000000-abcd', True)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from gpusnap.errors import CheckpointError
from gpusnap.storage.backend import fsync_path

__all__ = ["FORMAT", "Pointer", "read_pointer", "write_pointer"]

FORMAT = "gpusnap-checkpoint-pointer"
_MAX_BYTES = 64 << 10  # a pointer is ~300 bytes; anything larger is some other file (a torch.save)


@dataclass(frozen=True)
class Pointer:
    """A committed gpusnap checkpoint: its root (absolute) and id."""

    root: str
    checkpoint: str


def write_pointer(path: str, pointer: Pointer) -> None:
    """Atomically make ``path`` a pointer to ``pointer`` (replacing what is there)."""
    folder = os.path.dirname(os.path.abspath(path))
    document = {
        "format": FORMAT,
        "version": 1,
        "root": os.path.relpath(pointer.root, folder),
        "checkpoint": pointer.checkpoint,
        "note": "a gpusnap checkpoint: load it with GpusnapCheckpointIO().load_checkpoint(path), "
        "gpusnap.load(root, checkpoint), or `gpusnap show ROOT CHECKPOINT`",
    }
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_path(folder)  # the rename itself survives a power loss


def read_pointer(path: str) -> Pointer | None:
    """The pointer at ``path``; None when the file is something else (a ``torch.save``
    checkpoint, say). FileNotFoundError when nothing is there; a damaged pointer is a
    CheckpointError naming the file."""
    with open(path, "rb") as f:
        head = f.read(_MAX_BYTES + 1)
    if len(head) > _MAX_BYTES or not head.lstrip().startswith(b"{"):
        return None
    try:
        document = json.loads(head)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        return None
    root, checkpoint = document.get("root"), document.get("checkpoint")
    if document.get("version") != 1 or not isinstance(root, str) or not isinstance(checkpoint, str):
        raise CheckpointError(f"{path}: a damaged or newer gpusnap pointer file (version {document.get('version')!r})")
    # relative to where the file really is: a symlink to a pointer elsewhere reads its root
    folder = os.path.dirname(os.path.realpath(path))
    return Pointer(os.path.normpath(os.path.join(folder, root)), checkpoint)
