"""Compaction: an explicit gc rewrites the live chunks of mostly dead packs into new packs,
then deletes the old ones.

Manifests name chunks by digest and a chunk's location comes from the pack indexes
(docs/architecture.md), so compaction touches no manifest. Its order is a save's:

1. each live chunk of the chosen packs is read, checked against its digest and appended to
   a temporary pack under ``tmp/`` (unless a pack gc keeps already holds a good copy);
2. every new pack is finished (index, footer, fsync), renamed into ``packs/`` under its
   content name, and the directories are synced: now every live chunk is stored twice;
3. only then are the old packs deleted.

A crash or a failure before 3 leaves the old packs whole; new packs already published hold
copies, so the next gc finds every live chunk of the old packs in a pack it keeps, copies
nothing and deletes them. A crash in 1 leaves a ``tmp/`` file, which gc deletes. A crash in 3
leaves some old packs, deleted the same way. Readers that know an old pack find the chunk
again when it vanishes (``Repository.read_chunk``), as after any gc.

A chunk that does not match its digest is never copied: its pack is kept whole and the
problem is reported in verify's words. A copy held by a kept pack is checked too before
the old pack is given up for it.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpusnap.errors import IntegrityError, StorageError
from gpusnap.storage.lease import LEASE_NAME
from gpusnap.storage.layout import TMP, os_reason
from gpusnap.storage.pack import PackIndex, PackWriter
from gpusnap.storage.txn import publish_packs

if TYPE_CHECKING:
    from gpusnap.storage.repository import Repository

__all__ = ["Compaction", "KEPT", "compact", "dead_bytes", "mostly_dead"]

KEPT = "no checkpoint was changed: the packs being compacted are kept whole (run gc again)"


@dataclass(frozen=True)
class Compaction:
    """What one compaction did: old packs rewritten and deleted, new packs written, the live
    bytes copied, the bytes freed (old packs' size less the new ones'), and corrupt chunks
    found (their packs are kept whole)."""

    compacted: tuple[str, ...] = ()
    written: tuple[str, ...] = ()
    rewritten_bytes: int = 0
    freed_bytes: int = 0
    problems: tuple[str, ...] = ()


def dead_bytes(index: PackIndex, live: set[str]) -> int:
    """Bytes of ``index``'s chunks that no digest in ``live`` names."""
    return sum(n for d, _, n in index.entries if d not in live)


def mostly_dead(packs: list[PackIndex], live: set[str], percent: int) -> list[PackIndex]:
    """The packs that still hold a live chunk and of whose chunk bytes more than ``percent``
    per cent are dead, in path order (100: none)."""
    chosen = []
    for index in sorted(packs, key=lambda i: i.path):
        total = sum(n for _, _, n in index.entries)
        dead = dead_bytes(index, live)
        if percent < 100 and 0 < dead < total and dead * 100 > percent * total:
            chosen.append(index)
    return chosen


def compact(
    repo: Repository,
    chosen: list[PackIndex],
    kept: list[PackIndex],
    live: set[str],
    progress: Callable[[int], Callable[[int], None]] | None = None,
) -> Compaction:
    """Rewrite the ``live`` chunks of ``chosen`` into new packs, then delete ``chosen`` (but
    a pack with a corrupt live chunk). ``kept``: the packs gc keeps, whose good copies need
    no rewrite. Raises a :class:`StorageError` when reading or writing fails (nothing was
    deleted then); call it with the root to itself (writer lease, exclusive lock).

    ``progress``: called once with the bytes of the live chunks to go through (what is
    rewritten, but a chunk a kept pack holds a good copy of, or a corrupt one); the
    callable it returns is called with each chunk's length once it is dealt with."""
    if not chosen:
        return Compaction()
    elsewhere: dict[str, tuple[str, int, int]] = {}
    for index in kept:
        for digest, offset, length in index.entries:
            elsewhere.setdefault(digest, (index.path, offset, length))
    advance = _advance(chosen, live, progress)
    copier = _Copier(repo)
    problems: list[str] = []
    damaged: set[str] = set()
    try:
        for index in chosen:
            for digest, offset, length in index.entries:
                if digest not in live or copier.has(digest):
                    continue
                advance(digest, length)  # (as it begins: each way out below deals with it)
                held = elsewhere.get(digest)
                if held is not None:
                    problem = copier.check(digest, *held)
                    if problem is None:
                        copier.done.add(digest)
                        continue
                    problems.append(problem)  # the kept copy is bad: rewrite this one
                data = copier.read(digest, index.path, offset, length)
                if isinstance(data, str):
                    problems.append(data)
                    damaged.add(index.path)
                else:
                    copier.append(digest, data)
        published = copier.publish()
    finally:
        copier.discard()
    _confirm_lease(repo)  # (an object store's lease can be lost: then another writer may rely on them)
    old = [i for i in chosen if i.path not in damaged]
    repo.forget_packs([i.path for i in old])  # this process reads the new copies from now on
    for index in old:
        with _io(repo, "deleting compacted pack", index.path):
            repo.backend.remove(index.path)
    return Compaction(
        compacted=tuple(i.path for i in old),
        written=tuple(i.path for i in published),
        rewritten_bytes=copier.copied,
        freed_bytes=sum(i.size for i in old) - sum(i.size for i in published),
        problems=tuple(problems),
    )


def _advance(
    chosen: list[PackIndex], live: set[str], progress: Callable[[int], Callable[[int], None]] | None
) -> Callable[[str, int], None]:
    """``advance(digest, length)`` for each live chunk compaction goes through: the first time
    a digest comes, its length goes to ``progress``'s callable, whose total (every live
    digest's length) is told up front. A digest in two packs counts once: its second copy is
    read only when the first was corrupt."""
    if progress is None:
        return lambda digest, length: None
    sizes = {d: n for index in chosen for d, _, n in index.entries if d in live}
    step = progress(sum(sizes.values()))
    seen: set[str] = set()

    def advance(digest: str, length: int) -> None:
        if digest not in seen:
            seen.add(digest)
            step(length)

    return advance


def _confirm_lease(repo: Repository) -> None:
    """Check (and renew) the writer lease: a compaction may run longer than an object
    store's lease lives unrenewed."""
    with _io(repo, "confirming the writer lease", LEASE_NAME):
        repo.renew_lease()


@contextmanager
def _io(repo: Repository, doing: str, path: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise StorageError(f"gc: {doing} {repo.backend.describe(path)} failed: {os_reason(exc)}; {KEPT}") from exc


class _Copier:
    """The new packs of one compaction: chunks appended to temporary packs of at most
    ``config.pack_size``, published together (:func:`publish_packs`)."""

    def __init__(self, repo: Repository) -> None:
        self.repo = repo
        self.token = f"{os.getpid()}-{secrets.token_hex(4)}-compact"
        self.writer: PackWriter | None = None
        self.finished: list[PackIndex] = []
        self.done: set[str] = set()  # digests a kept or new pack holds, checked
        self.copied = 0
        self._seq = 0

    def has(self, digest: str) -> bool:
        return digest in self.done

    def check(self, digest: str, path: str, offset: int, length: int) -> str | None:
        """The problem with the copy at ``path`` (verify's words), or None."""
        data = self.read(digest, path, offset, length)
        return data if isinstance(data, str) else None

    def read(self, digest: str, path: str, offset: int, length: int) -> bytes | str:
        """A chunk's bytes, checked, or the problem with them."""
        with _io(self.repo, "compacting: reading pack", path):
            data = self.repo.backend.read_range(path, offset, length)
        try:
            self.repo.check_chunk(digest, data, path, offset, length, "")
        except IntegrityError as exc:
            return f"{exc}; gc kept its pack whole, run `gpusnap verify {self.repo.root}`"
        return data

    def append(self, digest: str, data: bytes) -> None:
        if self.writer is None:
            self._seq += 1
            path = f"{TMP}/{self.token}-{self._seq:04d}.pack"
            with _io(self.repo, "compacting: writing pack", path):
                self.writer = PackWriter(self.repo.backend, path, fsync=self.repo.config.fsync)
        writer = self.writer
        with _io(self.repo, "compacting: writing pack", writer.tmp_path):
            writer.append(digest, memoryview(data))
            if writer.nbytes >= self.repo.config.pack_size:
                self.finished.append(writer.finish())
                self.writer = None
        if self.writer is None:
            _confirm_lease(self.repo)
        self.done.add(digest)
        self.copied += len(data)

    def publish(self) -> list[PackIndex]:
        if self.writer is not None:
            writer = self.writer
            with _io(self.repo, "compacting: writing pack", writer.tmp_path):
                self.finished.append(writer.finish())
            self.writer = None
        published = publish_packs(
            self.repo, self.finished, lambda doing, path: _io(self.repo, f"compacting: {doing}", path)
        )
        self.finished = []
        return published

    def discard(self) -> None:
        """Remove what is still temporary (after a failure); never raises."""
        if self.writer is not None:
            self.writer.discard()
            self.writer = None
        for index in self.finished:
            try:
                self.repo.backend.remove(index.path)
            except OSError:
                pass
        self.finished = []
