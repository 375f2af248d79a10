"""Names and small helpers every part of a checkpoint root shares: the layout of the root,
the safe-id rule, and how a backend's OSError becomes a one-line :class:`StorageError`."""

from __future__ import annotations

import errno
import re

from gpusnap.errors import StorageError
from gpusnap.storage.lease import LEASE_NAME
from gpusnap.storage.pack import PackIndex

__all__ = [
    "INTACT", "ID_RE", "LAYOUT", "MANIFESTS", "PACKS", "RANKS", "ROOT_FILE", "TMP",
    "about", "byte_view", "map_chunks", "os_reason", "storage_error",
]

ROOT_FILE = "gpusnap.json"
PACKS, MANIFESTS, TMP = "packs", "manifests", "tmp"
RANKS = "ranks"  # a distributed checkpoint's per-rank roots (storage/ranks.py)
LAYOUT = frozenset({PACKS, MANIFESTS, TMP, RANKS, "lock", LEASE_NAME})
ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
INTACT = "this checkpoint was not committed; earlier checkpoints are intact"


def os_reason(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc) or type(exc).__name__
    return f"{text} [{name}]" if name else text


def storage_error(exc: OSError, doing: str, where: str, *, writing: bool) -> StorageError:
    """One line: what failed, where, and (for writes) that nothing earlier was harmed."""
    tail = f"; {INTACT}" if writing else ""
    return StorageError(f"{doing} {where} failed: {os_reason(exc)}{tail}")


def about(what: str) -> str:
    return f" ({what})" if what else ""


def map_chunks(into: dict[str, tuple[str, int, int]], index: PackIndex) -> None:
    """Add ``index``'s chunks to ``into`` (digest -> pack path, offset, length); a digest
    already mapped keeps its first pack."""
    for digest, offset, length in index.entries:
        into.setdefault(digest, (index.path, offset, length))


def byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")  # needs a C-contiguous buffer, as any chunk of a span is
    return view
