"""Pack files: many chunks in one immutable file, found through a trailing index.

Layout (version 1, see docs/architecture.md)::

    b"GSNPACK1" | chunk bytes back to back | JSON index | footer (40 bytes)
    index  = {"chunks": [[digest, offset, length], ...]}
    footer = index_offset u64le | index_length u64le | index_digest (16 bytes) | b"GSNPEND1"

The index sits at the end so a pack is written in one sequential pass, and it is checked by
its own digest so a torn or flipped index is detected before any offset is trusted. The pack
id (its file name) is the hex of that index digest: content-derived, so two writers that
produce the same pack agree on its name.

A pack of a local root written with ``direct=True`` goes through O_DIRECT
(``storage/direct_file.py``): a large chunk whose memory is block-aligned starts at a 4096
boundary, after zeros, and is written from that memory without a copy. Readers need no change:
the index names every offset, and chunks of whole blocks appended in turn stay back to back.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from gpusnap.errors import IntegrityError
from gpusnap.kernels.hashing import DIGEST_BYTES, chunk_digest
from gpusnap.storage.backend import Backend, WriteHandle
from gpusnap.storage.direct_file import DirectFile

__all__ = [
    "FOOTER_SIZE",
    "PACK_MAGIC",
    "PACK_END_MAGIC",
    "PackEntry",
    "PackIndex",
    "PackWriter",
    "pack_path",
    "parse_pack_tail",
    "read_pack_index",
]

PACK_MAGIC = b"GSNPACK1"
PACK_END_MAGIC = b"GSNPEND1"
_FOOTER = struct.Struct(f"<QQ{DIGEST_BYTES}s8s")
FOOTER_SIZE = _FOOTER.size  # 40
_TAIL_READ = 64 * 1024  # one read usually covers footer and index together

assert FOOTER_SIZE == 40


# Where one chunk lives inside a pack: ``(digest, offset, length)``. A plain tuple, not a
# class: a process keeps one per stored chunk of every retained checkpoint (16.6k for four
# of GPT-2 large), and Python's collector stops tracking an exact tuple of
# plain values, where it walked every dataclass instance at each full collection, on
# whichever thread was allocating (the training loop's, mostly).
PackEntry = tuple[str, int, int]  # (a type for annotations: build entries as plain tuples)


@dataclass(frozen=True)
class PackIndex:
    """A pack's parsed trailer: its id (index digest), file size and chunk entries."""

    path: str
    pack_id: str
    size: int
    entries: tuple[PackEntry, ...]


def pack_path(pack_id: str) -> str:
    """``packs/<aa>/<packid>.pack``: two-char fan-out keeps directories small."""
    return f"packs/{pack_id[:2]}/{pack_id}.pack"


def _encode_index(entries: list[PackEntry]) -> bytes:
    rows = [list(e) for e in entries]
    return json.dumps({"chunks": rows}, separators=(",", ":")).encode("ascii")


def _open_direct(backend: Backend, path: str) -> DirectFile | None:
    """``backend.open_direct_write(path)`` where the backend's class defines it (a local root).

    Looked up on the class: a wrapper that forwards unknown names through ``__getattr__``
    (the fault-injecting test backends) must keep seeing every write through ``open_write``.
    """
    method = getattr(type(backend), "open_direct_write", None)
    return None if method is None else method(backend, path)


class PackWriter:
    """Appends chunks to a temporary pack file; :meth:`finish` writes the trailer.

    ``direct``: write through O_DIRECT where the backend offers it (see the module docstring);
    :attr:`direct` says whether this pack is. Not thread-safe: the write transaction hands
    each writer to one thread at a time.
    """

    def __init__(self, backend: Backend, tmp_path: str, *, fsync: bool, direct: bool = False) -> None:
        self.backend = backend
        self.tmp_path = tmp_path
        self._fsync = fsync
        self._entries: list[PackEntry] = []
        self._file: DirectFile | None = _open_direct(backend, tmp_path) if direct else None
        self._handle: WriteHandle | None = backend.open_write(tmp_path) if self._file is None else None
        self.direct = self._file is not None and self._file.direct
        self.nbytes = 0  # the file's logical size so far (what ``Config.pack_size`` bounds)
        try:
            self._write(PACK_MAGIC)
        except BaseException:
            self.discard()
            raise

    def _write(self, data: bytes | memoryview) -> int:
        """Append ``data``; returns the offset it starts at."""
        if self._file is not None:
            offset = self._file.append(data)
            self.nbytes = self._file.size
            return offset
        assert self._handle is not None, "pack writer already closed"
        offset = self.nbytes
        self._handle.write(data)
        self.nbytes += len(data)
        return offset

    @property
    def entries(self) -> tuple[PackEntry, ...]:
        return tuple(self._entries)

    def append(self, digest: str, data: memoryview) -> None:
        """Write one chunk (a byte-format memoryview) and remember where it went."""
        offset = self._write(data)
        self._entries.append((digest, offset, len(data)))

    def append_run(self, digests: list[str], data: memoryview, lengths: list[int]) -> None:
        """Write chunks that lie back to back in ``data`` (``lengths`` each, in order) with one
        write: they lie back to back in the pack too. One large write instead of one per chunk
        is what keeps a background promotion off the training thread's interpreter lock."""
        if sum(lengths) != len(data) or len(digests) != len(lengths):
            raise ValueError(f"a run of {len(digests)} chunk(s), {sum(lengths)} bytes, does not fill {len(data)} bytes")
        offset = self._write(data)
        for digest, length in zip(digests, lengths):
            self._entries.append((digest, offset, length))
            offset += length

    def finish(self) -> PackIndex:
        """Write index and footer, close (fsync if configured); returns the pack's index."""
        index = _encode_index(self._entries)
        index_digest = chunk_digest(index)
        index_offset = self._write(index)
        footer = _FOOTER.pack(index_offset, len(index), bytes.fromhex(index_digest), PACK_END_MAGIC)
        footer_at = self._write(footer)
        assert footer_at == index_offset + len(index), "a small piece is never moved to a block boundary"
        file, self._file = self._file, None
        handle, self._handle = self._handle, None
        if file is not None:
            file.finish(sync=self._fsync)
        if handle is not None:
            handle.close(sync=self._fsync)
        return PackIndex(self.tmp_path, index_digest, self.nbytes, tuple(self._entries))

    def discard(self) -> None:
        """Close without syncing and remove the temporary file; never raises."""
        file, self._file = self._file, None
        handle, self._handle = self._handle, None
        try:
            if file is not None:
                file.close()
            if handle is not None:
                handle.close(sync=False)
        except OSError:
            pass
        try:
            self.backend.remove(self.tmp_path)
        except OSError:
            pass


def _parse_index(raw: bytes, index_offset: int, where: str) -> tuple[PackEntry, ...]:
    try:
        rows = json.loads(raw.decode("ascii"))["chunks"]
        entries = tuple((str(d), int(o), int(n)) for d, o, n in rows)
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"pack {where}: index is not valid JSON ({exc})") from None
    for digest, offset, length in entries:
        if offset < len(PACK_MAGIC) or length < 0 or offset + length > index_offset:
            raise IntegrityError(
                f"pack {where}: index entry {digest} [{offset}, +{length}) lies outside the chunk area"
            )
    return entries


def parse_pack_tail(tail: bytes, tail_offset: int, size: int, where: str) -> tuple[int, int, bytes]:
    """Check the footer at the end of ``tail`` (the file's last bytes, starting at ``tail_offset``).

    Returns ``(index_offset, index_length, index_digest)``; raises :class:`IntegrityError`.
    """
    if size < len(PACK_MAGIC) + FOOTER_SIZE or len(tail) < FOOTER_SIZE or tail_offset + len(tail) != size:
        raise IntegrityError(f"pack {where}: too short ({size} bytes) to hold a footer")
    index_offset, index_length, index_digest, end = _FOOTER.unpack(tail[-FOOTER_SIZE:])
    if end != PACK_END_MAGIC:
        raise IntegrityError(f"pack {where}: bad footer magic (truncated or not a gpusnap pack)")
    if index_offset < len(PACK_MAGIC) or index_offset + index_length != size - FOOTER_SIZE:
        raise IntegrityError(f"pack {where}: footer offsets do not match the file size {size}")
    return index_offset, index_length, index_digest


def read_pack_index(backend: Backend, path: str) -> PackIndex:
    """Read and check a pack's footer and index (usually one ranged read).

    Raises :class:`IntegrityError` for a damaged trailer, :class:`OSError` from the backend.
    """
    where = backend.describe(path)
    size = backend.size(path)
    tail_offset = max(0, size - _TAIL_READ)
    tail = backend.read_range(path, tail_offset, size - tail_offset)
    index_offset, index_length, index_digest = parse_pack_tail(tail, tail_offset, size, where)
    if index_offset >= tail_offset:
        start = index_offset - tail_offset
        raw = tail[start : start + index_length]
    else:
        raw = backend.read_range(path, index_offset, index_length)
    if len(raw) != index_length or bytes.fromhex(chunk_digest(raw)) != index_digest:
        raise IntegrityError(f"pack {where}: index does not match its digest (corrupt pack trailer)")
    return PackIndex(path, index_digest.hex(), size, _parse_index(raw, index_offset, where))
