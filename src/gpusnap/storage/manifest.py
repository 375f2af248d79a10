"""The manifest: one self-checking JSON document per checkpoint.

A manifest is what makes a checkpoint visible: it names every chunk by digest (locations come
from pack indexes) and carries the app_state tree and stats, which this layer treats as
opaque JSON. Its ``checksum`` covers the canonical JSON of every other field, so a flipped
byte or a torn write is an :class:`IntegrityError`, never a silently wrong restore.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from gpusnap.errors import CheckpointError, IntegrityError
from gpusnap.kernels.hashing import chunk_digest

__all__ = ["DEVICE_HASH", "FORMAT", "VERSION", "Manifest", "RankPart", "StorageEntry", "canonical_json"]

FORMAT = "gpusnap"
VERSION = 1
# a distributed checkpoint's global manifest (``ranks``): a gpusnap that predates it would read
# one as an empty checkpoint (listed, verified "ok", 0 bytes), so it must refuse it; every
# other manifest keeps VERSION (a rank's part is an ordinary manifest)
DISTRIBUTED_VERSION = 3
READABLE_VERSIONS = (VERSION, DISTRIBUTED_VERSION)


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON (sorted keys, compact, ASCII, no NaN): the bytes the checksum covers."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("ascii")


DEVICE_HASH = "nh128-v1"  # kernels.chunk_hash: the algorithm of StorageEntry.hashes


@dataclass(frozen=True)
class StorageEntry:
    """One stored span: its length and the digests of its chunks, in order.

    ``hashes`` (optional) are the chunks' device hashes (:data:`DEVICE_HASH`, 32 hex digits
    each, computed on the span's device at the consistent point): what incremental saves
    compare against, and what a restore may check on the device instead of re-reading BLAKE2b.
    """

    nbytes: int
    device: str
    chunks: tuple[str, ...]
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

    def without_data(self, spans: Collection[int]) -> Manifest:
        """This manifest with storages ``spans`` holding no bytes and no chunks: a reader of the
        copy reads nothing of theirs (what a partial restore or a ``load(keys=...)`` skips)."""
        return replace(self, storages=tuple(
            StorageEntry(nbytes=0, device=e.device, chunks=()) if i in spans else e
            for i, e in enumerate(self.storages)
        ))

    def _body(self) -> dict[str, Any]:
        body = {
            "format": FORMAT,
            "version": VERSION,
            "id": self.id,
            "tag": self.tag,
            "created": self.created,
            "chunk_size": self.chunk_size,
            "storages": [_entry_json(s) for s in self.storages],
            "tree": self.tree,
            "stats": self.stats,
        }
        if self.ranks:
            body["ranks"] = [{"rank": p.rank, "checksum": p.checksum, "nbytes": p.nbytes} for p in self.ranks]
            body["version"] = DISTRIBUTED_VERSION
        return body

    def to_json(self) -> bytes:
        """The file's bytes: canonical JSON of all fields plus ``checksum``."""
        body = self._body()
        try:
            encoded = canonical_json(body)
            checksum = chunk_digest(encoded)
            self.__dict__["checksum"] = checksum  # (the cached_property, worked out here once)
            # "checksum" sorts before every key of the body: splicing it in front gives the
            # canonical JSON of {**body, "checksum": ...} without encoding the body twice
            if min(body) > "checksum":
                return b'{"checksum":' + canonical_json(checksum) + b"," + encoded[1:]
            return canonical_json({**body, "checksum": checksum})
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
            storages = tuple(
                StorageEntry(
                    int(s["nbytes"]),
                    str(s["device"]),
                    tuple(str(c) for c in s["chunks"]),
                    None if s.get("hashes") is None else tuple(str(h) for h in s["hashes"]),
                )
                for s in doc["storages"]
            )
            for s in storages:
                if s.hashes is not None and len(s.hashes) != len(s.chunks):
                    raise ValueError("a storage has a different number of hashes and chunks")
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
                chunk_size=int(doc["chunk_size"]),
                storages=storages,
                tree=tree,
                stats=stats,
                ranks=ranks,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"manifest {where} is malformed (written by a buggy writer?): {exc!r}") from None


def _entry_json(s: StorageEntry) -> dict[str, Any]:
    out: dict[str, Any] = {"nbytes": s.nbytes, "device": s.device, "chunks": list(s.chunks)}
    if s.hashes is not None:  # absent, not null: manifests without hashes keep their bytes
        out["hashes"] = list(s.hashes)
    return out
