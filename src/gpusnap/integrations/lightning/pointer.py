"""Pointer files: what a Lightning checkpoint path holds when gpusnap stored the checkpoint.

Lightning treats a checkpoint as one file at a path: ``ModelCheckpoint`` checks that it
exists, sorts ``last*.ckpt`` by modification time, links or deletes it. So the path gets a
small JSON document naming the gpusnap root and checkpoint id; the state itself lives in the
root, where checkpoints share their unchanged chunks. A pointer is written atomically (a
temporary name, fsync, rename) once its checkpoint is committed.

A path's first save into a local root makes the path a symbolic link to the manifest its
checkpoint will be committed as (:func:`link_to_manifest`), as soon as ``save()`` returns:
Lightning's ``ckpt_path="last"`` only looks for files that exist, and this one exists exactly
once the checkpoint is committed, so a crash before the commit leaves nothing to resume
(Lightning starts afresh, as without gpusnap) and a crash after it, before the pointer is
written, leaves the path naming its checkpoint. A root that is not local gets a
*placeholder* first instead (:func:`write_placeholder`: the root, no checkpoint yet).
The root records the path of every checkpoint (:mod:`.records`); what a path names is
resolved from that record and the file together, so a placeholder or a pointer that a crash
left behind still leads to the newest checkpoint committed for its path.

The file opens with two lines that ``torch.load`` reads as a pickle naming an unknown
``gpusnap`` global, so ``LightningModule.load_from_checkpoint(path)`` fails with a message
that says how to load it (:data:`HEADER`); the JSON follows.

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
import re
import time
from dataclasses import dataclass
from typing import Any

from gpusnap.errors import CheckpointError
from gpusnap.storage.backend import fsync_path
from gpusnap.storage.layout import ID_RE, MANIFESTS

__all__ = ["FORMAT", "HEADER", "Placeholder", "Pointer", "link_to_manifest", "manifest_link", "read_pointer",
           "write_placeholder", "write_pointer"]

FORMAT = "gpusnap-checkpoint-pointer"
HEADER = (b"cgpusnap\npointer: not a torch.save file; load it with "
          b"gpusnap.integrations.lightning.load_from_checkpoint(YourModule, path)\n")
"""What a pointer file opens with: a pickle GLOBAL opcode (``c``, module, name), so that
``torch.load`` fails naming it (``weights_only=True``: an unsupported global; ``False``: no
such attribute of ``gpusnap``) instead of an anonymous "invalid load key"."""
_MAX_BYTES = 64 << 10  # a pointer is ~500 bytes; anything larger is some other file (a torch.save)


@dataclass(frozen=True)
class Pointer:
    """A committed gpusnap checkpoint: its root (absolute) and id."""

    root: str
    checkpoint: str


@dataclass(frozen=True)
class Placeholder:
    """What a path holds from its first save until that checkpoint commits: the root the
    checkpoint goes to, and when the placeholder was written (checkpoints recorded for the
    path before then belong to an earlier file there)."""

    root: str
    since: float


def write_pointer(path: str, pointer: Pointer) -> None:
    """Atomically make ``path`` a pointer to ``pointer`` (replacing what is there)."""
    _write(path, pointer.root, {
        "checkpoint": pointer.checkpoint,
        "note": "a gpusnap checkpoint: load it with GpusnapCheckpointIO().load_checkpoint(path), "
        "gpusnap.integrations.lightning.load_from_checkpoint(YourModule, path), "
        "or `gpusnap show ROOT CHECKPOINT`",
    })


def write_placeholder(path: str, root: str) -> Placeholder:
    """Atomically make ``path`` a placeholder for a checkpoint about to be saved in ``root``."""
    placeholder = Placeholder(os.path.abspath(root), time.time())
    _write(path, placeholder.root, {
        "checkpoint": None,
        "since": placeholder.since,
        "note": "a gpusnap checkpoint being saved: GpusnapCheckpointIO loads the newest one committed "
        "for this path",
    })
    return placeholder


def link_to_manifest(path: str, root: str, checkpoint: str) -> bool:
    """Atomically make ``path`` a symbolic link (relative) to the manifest ``checkpoint`` is
    committed as in the local ``root``; False (nothing done) where ``root`` is not local."""
    local = root.removeprefix("file://")
    if "://" in local:
        return False
    folder = os.path.dirname(os.path.abspath(path))
    target = os.path.join(os.path.abspath(local), MANIFESTS, f"{checkpoint}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    os.symlink(os.path.relpath(target, folder), tmp)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.remove(tmp)
        raise
    fsync_path(folder)
    return True


_MANIFEST_LINK = re.compile(rf"(?P<root>.*)/{MANIFESTS}/(?P<id>[^/]+)\.json")


def manifest_link(path: str) -> Pointer | None:
    """The checkpoint a link made by :func:`link_to_manifest` names, reached through any links
    (Lightning's ``save_last="link"`` links last.ckpt to the top-k file), or None (not one)."""
    if not os.path.islink(path):
        return None
    m = _MANIFEST_LINK.fullmatch(os.path.realpath(path))
    if m is None or not ID_RE.match(m["id"]):
        return None
    return Pointer(m["root"], m["id"])


def _write(path: str, root: str, fields: dict[str, Any]) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    document = {"format": FORMAT, "version": 1, "root": os.path.relpath(root, folder), **fields}
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(HEADER + json.dumps(document, indent=1).encode("utf-8") + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_path(folder)  # the rename itself survives a power loss


def read_pointer(path: str) -> Pointer | Placeholder | None:
    """The pointer or placeholder at ``path``; None when the file is something else (a
    ``torch.save`` checkpoint, say). FileNotFoundError when nothing is there; a damaged
    pointer is a CheckpointError naming the file."""
    linked = manifest_link(path)
    if linked is not None:
        return linked
    with open(path, "rb") as f:
        head = f.read(_MAX_BYTES + 1)
    if len(head) > _MAX_BYTES:
        return None
    head = head.removeprefix(HEADER)  # (pointers written before the header have none)
    if not head.lstrip().startswith(b"{"):
        return None
    try:
        document = json.loads(head)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        return None
    root, checkpoint, since = document.get("root"), document.get("checkpoint"), document.get("since")
    if document.get("version") == 1 and isinstance(root, str):
        # relative to where the file really is: a symlink to a pointer elsewhere reads its root
        root = os.path.normpath(os.path.join(os.path.dirname(os.path.realpath(path)), root))
        if isinstance(checkpoint, str):
            return Pointer(root, checkpoint)
        if checkpoint is None and isinstance(since, (int, float)):
            return Placeholder(root, float(since))
    raise CheckpointError(f"{path}: a damaged or newer gpusnap pointer file (version {document.get('version')!r})")
