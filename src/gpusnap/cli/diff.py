"""``gpusnap diff ROOT A B``: which tensors changed between two checkpoints, and how many
bytes they have in common, decided from the manifests' chunk digests (no chunk is read).

A tensor is *equal* when its dtype, shape, stride and offset are the same and every chunk
holding its bytes has the same digest in both; otherwise *changed*. Digests cover whole
chunks, so "changed" can also mean that another tensor on the same storage changed a chunk
they share, or that the two were saved with different chunk sizes: ``changed_bytes`` (the
tensor's bytes in chunks that differ) is an upper bound on what differs, never an
underestimate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpusnap.cli.extents import Chunk, device_hashed, manifest_chunks, storage_chunks, tensor_chunks, tensor_extent
from gpusnap.cli.summary import Entry, keyed_entries, tensor_itemsize, tensor_nbytes
from gpusnap.storage.manifest import Manifest, canonical_json

__all__ = ["BLAKE2B", "NH128", "Diff", "EntryChange", "STATUSES", "diff_manifests"]

STATUSES = ("changed", "added", "removed", "equal")
BLAKE2B = "blake2b-128"
NH128 = "nh128"
_LAYOUT = ("dtype", "shape", "stride", "byte_offset")


@dataclass(frozen=True)
class EntryChange:
    """One key path: its status and, for a tensor, its dtype, shape and bytes (B's; A's when
    removed) and ``changed_bytes`` (0 when equal; all of them when added, removed or reshaped)."""

    key: str
    status: str
    dtype: str | None = None
    shape: tuple[int, ...] = ()
    nbytes: int | None = None
    changed_bytes: int | None = None
    note: str = ""


@dataclass(frozen=True)
class Diff:
    """Tensors and plain values of ``b`` against ``a``, and their chunks' bytes: ``shared``
    (a digest both name, counted once) and only in ``a`` or only in ``b``."""

    a: Manifest
    b: Manifest
    tensors: tuple[EntryChange, ...]
    values: tuple[EntryChange, ...]
    shared_bytes: int
    shared_chunks: int
    a_only_bytes: int
    a_only_chunks: int
    b_only_bytes: int
    b_only_chunks: int
    compared_by: str = BLAKE2B
    """What decided "equal": :data:`BLAKE2B` (a checkpoint root's digests) or :data:`NH128`
    (a fast tier's device hashes, in its chunk names: made for change detection, not identity)."""

    def count(self, status: str, *, values: bool = False) -> int:
        return sum(1 for e in (self.values if values else self.tensors) if e.status == status)


def diff_manifests(a: Manifest, b: Manifest) -> Diff:
    contents_a, contents_b = _contents(a), _contents(b)
    shared = contents_a.keys() & contents_b.keys()
    a_only = contents_a.keys() - shared
    b_only = contents_b.keys() - shared
    entries_a, entries_b = keyed_entries(a, b)  # matched by their keys, not by how they print
    tensors_a, values_a = _split(entries_a)
    tensors_b, values_b = _split(entries_b)
    return Diff(
        a=a,
        b=b,
        tensors=tuple(_tensor_changes(a, b, tensors_a, tensors_b)),
        values=tuple(_value_changes(values_a, values_b)),
        shared_bytes=sum(contents_a[c] for c in shared),
        shared_chunks=len(shared),
        a_only_bytes=sum(contents_a[c] for c in a_only),
        a_only_chunks=len(a_only),
        b_only_bytes=sum(contents_b[c] for c in b_only),
        b_only_chunks=len(b_only),
        compared_by=NH128 if device_hashed(a) or device_hashed(b) else BLAKE2B,
    )


def _contents(m: Manifest) -> dict[tuple[str, int], int]:
    """Distinct chunk contents of ``m`` (content, length) -> length."""
    return {(c.content, c.nbytes): c.nbytes for c in manifest_chunks(m)}


_Nodes = dict[tuple[str, ...], Entry]


def _split(listed: list[Entry]) -> tuple[_Nodes, _Nodes]:
    tensors: _Nodes = {}
    values: _Nodes = {}
    for e in listed:
        (tensors if e.node.get("t") == "tensor" else values)[e.path] = e
    return tensors, values


def _ordered(a: _Nodes, b: _Nodes) -> list[tuple[str, ...]]:
    """A's keys in A's order, then those only B has in B's order."""
    return list(a) + [k for k in b if k not in a]


def _tensor_changes(a: Manifest, b: Manifest, entries_a: _Nodes, entries_b: _Nodes) -> list[EntryChange]:
    chunks_a: dict[int, list[Chunk]] = {}
    chunks_b: dict[int, list[Chunk]] = {}
    out: list[EntryChange] = []
    for path in _ordered(entries_a, entries_b):
        ea, eb = entries_a.get(path), entries_b.get(path)
        key = (eb or ea).key  # type: ignore[union-attr]  # (one of them is there)
        na, nb = (ea.node if ea else None), (eb.node if eb else None)
        node = nb if nb is not None else na
        assert node is not None
        nbytes = tensor_nbytes(node)
        meta = {
            "dtype": str(node.get("dtype")),
            "shape": tuple(int(d) for d in node.get("shape", ())),
            "nbytes": nbytes,
        }
        if na is None or nb is None:
            out.append(EntryChange(key, "added" if na is None else "removed", **meta, changed_bytes=nbytes))
            continue
        moved = [f for f in _LAYOUT if na.get(f) != nb.get(f)]
        if moved:
            note = "; ".join(f"{f} {_text(na.get(f))} -> {_text(nb.get(f))}" for f in moved)
            out.append(EntryChange(key, "changed", **meta, changed_bytes=nbytes, note=note))
            continue
        held_a, _ = _held(a, na, chunks_a)
        held_b, (lo, hi) = _held(b, nb, chunks_b)
        if [(c.start, c.nbytes, c.content) for c in held_a] == [(c.start, c.nbytes, c.content) for c in held_b]:
            out.append(EntryChange(key, "equal", **meta, changed_bytes=0))
            continue
        same = {(c.start, c.nbytes, c.content) for c in held_a}
        differ = sum(
            min(hi, c.start + c.nbytes) - max(lo, c.start)
            for c in held_b
            if (c.start, c.nbytes, c.content) not in same
        )
        out.append(EntryChange(key, "changed", **meta, changed_bytes=differ))
    return out


def _held(m: Manifest, node: dict[str, Any], cache: dict[int, list[Chunk]]) -> tuple[tuple[Chunk, ...], tuple[int, int]]:
    """The chunks holding a tensor node's bytes, and its byte range in its storage."""
    index = int(node["storage"])
    entry = m.storages[index]
    if index not in cache:
        cache[index] = storage_chunks(entry, m.chunk_size)
    lo, hi = tensor_extent(node, tensor_itemsize(node), entry.nbytes)
    return tensor_chunks(cache[index], lo, hi), (lo, hi)


def _value_changes(entries_a: _Nodes, entries_b: _Nodes) -> list[EntryChange]:
    out: list[EntryChange] = []
    for path in _ordered(entries_a, entries_b):
        ea, eb = entries_a.get(path), entries_b.get(path)
        if ea is None or eb is None:
            out.append(EntryChange((eb or ea).key, "added" if ea is None else "removed"))  # type: ignore[union-attr]
        else:
            out.append(EntryChange(eb.key, "equal" if canonical_json(ea.node) == canonical_json(eb.node) else "changed"))
    return out


def _text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "x".join(map(str, value)) or "scalar"
    return str(value)
