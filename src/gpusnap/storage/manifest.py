"""The manifest: one self-checking JSON document per checkpoint.

A manifest is what makes a checkpoint visible: it names every chunk by digest (locations come
from pack indexes) and carries the app_state tree and stats, which this layer treats as
opaque JSON. Its ``checksum`` covers the canonical JSON of every other field, so a flipped
byte or a torn write is an :class:`IntegrityError`, never a silently wrong restore.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from gpusnap.errors import CheckpointError, IntegrityError
from gpusnap.kernels.hashing import chunk_digest
from gpusnap.storage.canonical import TreeCodes, canonical_json, join_object
from gpusnap.storage.chunk_names import device_hash_of, is_device_name
from gpusnap.storage.fast_chunks import FastChunks

__all__ = ["DEVICE_HASH", "DEVICE_NAMED_VERSION", "DISTRIBUTED_VERSION", "FAST_VERSION", "FORMAT", "READABLE_VERSIONS", "VERSION", "Manifest", "RankPart",
           "StorageEntry", "canonical_json"]

FORMAT = "gpusnap"
VERSION = 1
# a manifest that stores fast-tier spans compactly (storage/fast_chunks.py); every other
# manifest keeps VERSION, so a durable root stays readable by a gpusnap that predates it
FAST_VERSION = 2
# a distributed checkpoint's global manifest (``ranks``): a gpusnap that predates it would read
# one as an empty checkpoint (listed, verified "ok", 0 bytes), so it must refuse it; a rank's
# part is an ordinary manifest
DISTRIBUTED_VERSION = 3
# a manifest naming chunks by their device hash (``nh:...``, storage/chunk_names.py): a gpusnap
# that predates it would check those chunks with BLAKE2b and call every one corrupt
DEVICE_NAMED_VERSION = 4
READABLE_VERSIONS = (VERSION, FAST_VERSION, DISTRIBUTED_VERSION, DEVICE_NAMED_VERSION)


DEVICE_HASH = "nh128-v1"  # kernels.chunk_hash: the algorithm of StorageEntry.hashes


@dataclass(frozen=True)
class StorageEntry:
    """One stored span: its length and the digests of its chunks, in order.

    ``hashes`` (optional) are the chunks' device hashes (:data:`DEVICE_HASH`, 32 hex digits
    each, computed on the span's device at the consistent point): what incremental saves
    compare against, and what a restore may check on the device instead of re-reading BLAKE2b.
    ``chunks`` is a tuple of names, or for a fast-tier span a
    :class:`~gpusnap.storage.fast_chunks.FastChunks` (the same names, held as runs of slab
    bytes; its manifest is of :data:`FAST_VERSION`).
    """

    nbytes: int
    device: str
    chunks: Sequence[str]
    hashes: tuple[str, ...] | None = None


@dataclass(frozen=True)
class RankPart:
    """One rank's part of a distributed checkpoint: its rank manifest (``ranks/<rank>/
    manifests/<id>.json``, storage/ranks.py), named by the checksum it must carry."""

    rank: int
    checksum: str
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint. ``tree`` and ``stats`` belong to the layers above.

    A distributed checkpoint's *global* manifest has ``ranks`` (one part per rank, in rank
    order) and no storages; it is written as :data:`DISTRIBUTED_VERSION`, which a gpusnap that
    predates it refuses (its tree, ``{"t": "ranks"}``, is no state either). Each rank's state
    is in its rank manifest, an ordinary one (a DTensor there is a ``dtensor`` node, which an
    older gpusnap refuses to restore as an unknown node kind)."""

    id: str
    tag: str | None
    created: float
    chunk_size: int
    storages: tuple[StorageEntry, ...]
    tree: dict[str, Any]
    stats: dict[str, Any]
    ranks: tuple[RankPart, ...] = ()

    @property
    def world_size(self) -> int:
        return len(self.ranks) or 1

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in the checkpoint (before deduplication; of every rank)."""
        if self.ranks:
            return sum(p.nbytes for p in self.ranks)
        return sum(s.nbytes for s in self.storages)

    @cached_property
    def checksum(self) -> str:
        """The checksum its file carries (what a global manifest names a rank manifest by);
        worked out once (the tree is read only)."""
        return chunk_digest(canonical_json(self._body()))

    def digest(self) -> str:
        """The checksum its file carries (BLAKE2b of the canonical JSON of every other field):
        names this exact manifest, e.g. between a restore server and its client."""
        return self.checksum

    @property
    def version(self) -> int:
        """The format version its file has: :data:`FAST_VERSION` when a span is stored as
        runs (a fast tier's), :data:`DEVICE_NAMED_VERSION` when a chunk is named by its
        device hash (a promotion's), else :data:`VERSION`."""
        if self.ranks:
            return DISTRIBUTED_VERSION
        if any(isinstance(s.chunks, FastChunks) for s in self.storages):
            return FAST_VERSION
        return DEVICE_NAMED_VERSION if self._device_named() else VERSION

    def _device_named(self) -> bool:
        return any(is_device_name(c) for s in self.storages if not isinstance(s.chunks, FastChunks) for c in s.chunks)

    def without_data(self, spans: Collection[int]) -> Manifest:
        """This manifest with storages ``spans`` holding no bytes and no chunks: a reader of the
        copy reads nothing of theirs (what a partial restore or a ``load(keys=...)`` skips)."""
        return replace(self, storages=tuple(
            StorageEntry(nbytes=0, device=e.device, chunks=()) if i in spans else e
            for i, e in enumerate(self.storages)
        ))

    def _head(self) -> dict[str, Any]:
        """Every field of the file but ``storages``, ``tree`` and ``checksum``."""
        head = {
            "format": FORMAT,
            "version": self.version,
            "id": self.id,
            "tag": self.tag,
            "created": self.created,
            "chunk_size": self.chunk_size,
            "stats": self.stats,
        }
        if self.ranks:
            head["ranks"] = [{"rank": p.rank, "checksum": p.checksum, "nbytes": p.nbytes} for p in self.ranks]
        return head

    def _body(self) -> dict[str, Any]:
        return {**self._head(), "storages": [_entry_json(s, self.chunk_size) for s in self.storages],
                "tree": self.tree}

    def to_json(self, trees: TreeCodes | None = None) -> bytes:
        """The file's bytes: canonical JSON of all fields plus ``checksum``.

        ``trees``: a writer's memory of the tree nodes its previous manifests encoded
        (storage/canonical.py), so that a tree laid out as before is not encoded again."""
        try:
            # encoded in parts, then spliced: a fast span's record is written from its runs
            # directly, and the tree's unchanged nodes come from ``trees``
            parts = {k: canonical_json(v).decode("ascii") for k, v in self._head().items()}
            parts["storages"] = _storages_text(self.storages, self.chunk_size)
            parts["tree"] = trees.encode(self.tree) if trees is not None else canonical_json(self.tree).decode("ascii")
            encoded = join_object(parts).encode("ascii")
            checksum = chunk_digest(encoded)
            self.__dict__["checksum"] = checksum  # (the cached_property, worked out here once)
            # "checksum" sorts before every key of the body: splicing it in front gives the
            # canonical JSON of {**body, "checksum": ...} without joining the body twice
            if min(parts) > "checksum":
                return b'{"checksum":' + canonical_json(checksum) + b"," + encoded[1:]
            return join_object({**parts, "checksum": canonical_json(checksum).decode("ascii")}).encode("ascii")
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"manifest {self.id}: tree/stats must be plain JSON (no NaN, no objects): {exc}"
            ) from None

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse and check a manifest; ``where`` (its path) appears in every error."""
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise IntegrityError(f"manifest {where} is unreadable (truncated or corrupt): {exc}") from None
        if not isinstance(doc, dict):
            raise IntegrityError(f"manifest {where} is not a JSON object (corrupt)")
        if doc.get("format") != FORMAT or doc.get("version") not in READABLE_VERSIONS:
            raise CheckpointError(
                f"manifest {where} has format {doc.get('format')!r} version {doc.get('version')!r}; "
                f"this gpusnap reads {FORMAT!r} versions {', '.join(map(str, READABLE_VERSIONS))} "
                "(upgrade gpusnap to read it)"
            )
        checksum = doc.pop("checksum", None)
        try:
            expected = chunk_digest(canonical_json(doc))
        except ValueError as exc:  # NaN/Infinity literals: never written by to_json
            raise IntegrityError(f"manifest {where} is corrupt: {exc}") from None
        if checksum != expected:
            raise IntegrityError(f"manifest {where} fails its checksum (corrupt or modified)")
        try:
            chunk_size = int(doc["chunk_size"])
            storages = tuple(_entry(s, chunk_size) for s in doc["storages"])
            for s in storages:
                if s.hashes is not None and len(s.hashes) != len(s.chunks):
                    raise ValueError("a storage has a different number of hashes and chunks")
            if any(isinstance(s.chunks, FastChunks) for s in storages) != (doc["version"] == FAST_VERSION):
                raise ValueError(f"version {doc['version']} names spans stored as runs only in version {FAST_VERSION}")
            named = [c for s in storages if not isinstance(s.chunks, FastChunks) for c in s.chunks if is_device_name(c)]
            if bool(named) != (doc["version"] == DEVICE_NAMED_VERSION):
                raise ValueError(f"chunks named by their device hash appear in version {DEVICE_NAMED_VERSION} only")
            for c in named:
                device_hash_of(c)  # (a malformed name: ValueError)
            tree, stats = doc["tree"], doc["stats"]
            if not isinstance(tree, dict) or not isinstance(stats, dict):
                raise TypeError("tree and stats must be objects")
            tag = doc["tag"]
            ranks = tuple(RankPart(int(p["rank"]), str(p["checksum"]), int(p["nbytes"])) for p in doc.get("ranks", ()))
            if [p.rank for p in ranks] != list(range(len(ranks))):
                raise ValueError("a distributed manifest names one part per rank, in rank order")
            return cls(
                id=str(doc["id"]),
                tag=None if tag is None else str(tag),
                created=float(doc["created"]),
                chunk_size=chunk_size,
                storages=storages,
                tree=tree,
                stats=stats,
                ranks=ranks,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"manifest {where} is malformed (written by a buggy writer?): {exc!r}") from None


def _entry_json(s: StorageEntry, chunk_size: int) -> dict[str, Any]:
    if isinstance(s.chunks, FastChunks):  # runs, and the hashes in one string (both its chunks' and ``hashes``)
        _check_fast(s, chunk_size)
        return {"nbytes": s.nbytes, "device": s.device, **s.chunks.to_json()}
    out: dict[str, Any] = {"nbytes": s.nbytes, "device": s.device, "chunks": list(s.chunks)}
    if s.hashes is not None:  # absent, not null: manifests without hashes keep their bytes
        out["hashes"] = list(s.hashes)
    return out


def _storages_text(storages: tuple[StorageEntry, ...], chunk_size: int) -> str:
    """The canonical JSON of ``[_entry_json(s) for s in storages]``, a fast span's written
    from its record directly (no dict, no list per run for json to walk)."""
    if not any(isinstance(s.chunks, FastChunks) for s in storages):
        return canonical_json([_entry_json(s, chunk_size) for s in storages]).decode("ascii")
    return "[" + ",".join(_fast_entry_text(s, chunk_size) if isinstance(s.chunks, FastChunks)
                          else canonical_json(_entry_json(s, chunk_size)).decode("ascii") for s in storages) + "]"


def _fast_entry_text(s: StorageEntry, chunk_size: int) -> str:
    fast = s.chunks
    assert isinstance(fast, FastChunks)
    _check_fast(s, chunk_size)
    device = _device_text.get(s.device)
    if device is None:
        device = _device_text.setdefault(s.device, canonical_json(s.device).decode("ascii"))
    runs = ",".join([f"[{a},{b},{c}]" for a, b, c in fast.runs])
    # (keys in sorted order; the hashes are hex digits: nothing to escape)
    return f'{{"device":{device},"hashes":"{"".join(fast.hashes)}","nbytes":{int(s.nbytes)},"runs":[{runs}]}}'


_device_text: dict[str, str] = {}  # device -> its JSON string (a handful of devices)


def _check_fast(s: StorageEntry, chunk_size: int) -> None:
    fast = s.chunks
    assert isinstance(fast, FastChunks)
    if (s.hashes is not fast.hashes and (s.hashes is None or s.hashes != fast.hashes)) or (
            fast.nbytes, fast.chunk_size) != (s.nbytes, chunk_size):
        raise CheckpointError(
            "a fast span's record must carry its entry's device hashes, byte count and the manifest's chunk size"
        )


def _entry(doc: dict[str, Any], chunk_size: int) -> StorageEntry:
    """A storage entry's document: ``chunks`` (names) and optional ``hashes`` (a list), or a
    fast span's ``runs`` and ``hashes`` (one string), which are its device hashes too."""
    nbytes, device = int(doc["nbytes"]), str(doc["device"])
    if "runs" in doc:
        if "chunks" in doc:
            raise ValueError("a storage entry has both chunks and runs")
        fast = FastChunks.from_json(doc, nbytes=nbytes, chunk_size=chunk_size)
        return StorageEntry(nbytes, device, fast, fast.hashes)
    hashes = doc.get("hashes")
    return StorageEntry(nbytes, device, tuple(str(c) for c in doc["chunks"]),
                        None if hashes is None else tuple(str(h) for h in hashes))
