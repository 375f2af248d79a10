"""The read side of a repository: which pack holds each chunk, and reading chunks back.

:class:`PackReads` is a part of :class:`~gpusnap.storage.repository.Repository` (a base
class it builds on, one idea per file): the pack listing and chunk map under the
repository's mutexes, and reads that verify each chunk against its digest. A fast tier
overrides where a chunk is (its name says) and how it is checked (its device hash).
"""

from __future__ import annotations

import builtins
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpusnap.errors import IntegrityError, StorageError
from gpusnap.kernels.hashing import chunk_digest
from gpusnap.storage.chunk_names import device_hash_of, is_device_name
from gpusnap.storage.host_bytes_hash import hash_host_bytes
from gpusnap.storage.backend_protocol import Backend
from gpusnap.storage.layout import PACKS, about, byte_view, map_chunks, storage_error
from gpusnap.storage.pack import PackIndex, read_pack_index

if TYPE_CHECKING:
    import torch

# Device-named runs are checked on a GPU this many bytes at a time: each reader thread's
# device scratch stays this small
CHECK_SLICE_BYTES = 4 << 20

__all__ = ["ChunkReads", "PackReads", "matches_name"]


@dataclass(frozen=True)
class ChunkReads:
    """What one :meth:`PackReads.read_chunks_into` cost: system reads, seconds reading and verifying."""

    reads: int
    read_s: float
    verify_s: float


class PackReads:
    """Chunks by digest: where they are (the packs listed) and their verified bytes."""

    backend: Backend
    root: str
    _mutex: threading.RLock
    _refresh_mutex: threading.RLock  # also held by gc: no pack it dooms comes back
    _packs: dict[str, PackIndex]
    _chunks: dict[str, tuple[str, int, int]]

    def listdir(self, path: str) -> builtins.list[str]:
        """Names under ``path``; a missing directory is empty (object stores have no empty dirs)."""
        try:
            return self.backend.listdir(path)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise storage_error(exc, "listing", self.backend.describe(path), writing=False) from exc

    def _pack_paths(self) -> builtins.list[str]:
        return self.pack_paths()  # (the name ``gpusnap du`` calls)

    def pack_paths(self) -> builtins.list[str]:
        """Every pack under the root now (a fresh listing)."""
        paths: builtins.list[str] = []
        for fan in self.listdir(PACKS):
            if len(fan) != 2:
                continue
            paths.extend(f"{PACKS}/{fan}/{n}" for n in self.listdir(f"{PACKS}/{fan}") if n.endswith(".pack"))
        return paths

    def _refresh_packs(self, errors: builtins.list[tuple[str, str]] | None = None, *, wanted: str | None = None) -> None:
        """Re-list ``packs/``: forget vanished packs (another gc), index new ones from their trailers.

        A damaged trailer is skipped (its chunks count as missing); with ``errors`` given, every
        failure is collected there instead of a backend error being raised. ``wanted``: the
        chunk a reader misses; a refresh that another reader finished meanwhile may have
        found it (a restore's threads miss the same new pack together: one lists it).
        """
        with self._refresh_mutex:
            if wanted is not None:
                with self._mutex:
                    if wanted in self._chunks:
                        return
            present = self.pack_paths()
            with self._mutex:
                gone = set(self._packs) - set(present)
                for path in gone:
                    del self._packs[path]
                if gone:
                    self._rebuild_chunk_map()
                new = [p for p in present if p not in self._packs]
            for path in new:
                try:
                    index = read_pack_index(self.backend, path)
                except FileNotFoundError:
                    continue
                except IntegrityError as exc:
                    if errors is not None:
                        errors.append((path, str(exc)))
                    continue
                except OSError as exc:
                    err = storage_error(exc, "reading pack index", self.backend.describe(path), writing=False)
                    if errors is None:
                        raise err from exc
                    errors.append((path, str(err)))
                    continue
                self.add_pack(index)

    def _rebuild_chunk_map(self) -> None:
        self._chunks = {}
        for index in self._packs.values():
            map_chunks(self._chunks, index)

    def add_pack(self, index: PackIndex) -> None:
        """Make a pack just published (a commit's, a compaction's) readable here."""
        with self._mutex:
            self._packs[index.path] = index
            map_chunks(self._chunks, index)

    def is_stored(self, digest: str) -> bool:
        """Whether a pack this object knows holds chunk ``digest``."""
        with self._mutex:
            return digest in self._chunks

    def _locate(self, digest: str, what: str) -> tuple[str, int, int]:
        with self._mutex:
            loc = self._chunks.get(digest)
        if loc is None:
            self._refresh_packs(wanted=digest)
            with self._mutex:
                loc = self._chunks.get(digest)
        if loc is None:
            raise IntegrityError(f"chunk {digest}{about(what)} is missing: no pack under {self.root} holds it")
        return loc

    def _forget_pack(self, path: str) -> None:
        self.forget_packs([path])

    def forget_packs(self, paths: Sequence[str]) -> None:
        """Stop reading from ``paths`` (deleted or replaced by a compaction)."""
        with self._mutex:
            if [self._packs.pop(path, None) for path in paths if path in self._packs]:
                self._rebuild_chunk_map()

    # ------------------------------------------------------------------ reading chunks

    def chunk_length(self, digest: str) -> int:
        """Stored length of a chunk (for sizing a :meth:`read_chunk_into` buffer)."""
        return self._locate(digest, "")[2]

    def read_chunk(self, digest: str, *, what: str = "") -> bytes:
        """A chunk's bytes, verified against ``digest``."""
        path, offset, length = self._locate(digest, what)
        try:
            data = self.backend.read_range(path, offset, length)
        except FileNotFoundError:
            # Deleted by a gc elsewhere (the chunk may live in another pack too): look again.
            self._forget_pack(path)
            path, offset, length = self._locate(digest, what)
            try:
                data = self.backend.read_range(path, offset, length)
            except OSError as exc:
                raise self.read_error(exc, path, what) from exc
        except OSError as exc:
            raise self.read_error(exc, path, what) from exc
        self.check_chunk(digest, data, path, offset, length, what)
        return data

    def read_chunk_into(self, digest: str, out: memoryview, *, what: str = "", verify: bool = True) -> None:
        """Read a chunk straight into ``out`` (exactly its length), then verify it in place.

        ``verify=False`` skips the digest check (never the length check): for callers that
        chose speed over integrity, e.g. ``restore(..., verify="off")``.
        """
        view = byte_view(out)
        if view.readonly:
            raise ValueError("read_chunk_into needs a writable buffer")
        for attempt in (0, 1):
            path, offset, length = self._locate(digest, what)
            if length != len(view):
                raise IntegrityError(
                    f"chunk {digest}{about(what)} in pack {self.backend.describe(path)} is {length} bytes, "
                    f"the checkpoint expects {len(view)}"
                )
            try:
                got = self.backend.readinto_range(path, offset, view)
            except FileNotFoundError as exc:
                if attempt:
                    raise self.read_error(exc, path, what) from exc
                self._forget_pack(path)
                continue
            except OSError as exc:
                raise self.read_error(exc, path, what) from exc
            if verify:
                self.check_chunk(digest, view[:got], path, offset, length, what)
            elif got != length:
                raise IntegrityError(
                    f"chunk {digest}{about(what)} in pack {self.backend.describe(path)} is truncated: "
                    f"{got} of {length} bytes"
                )
            return

    def read_chunks_into(
        self, digests: Sequence[str], out: memoryview, chunk_size: int, *, what: str = "", verify: bool = True,
        check_on: torch.device | None = None,
    ) -> ChunkReads:
        """Read consecutive chunks of one span into ``out`` (chunk ``j`` at ``j * chunk_size``).

        Chunks that sit back to back in one pack (a capture writes a span's chunks mostly in
        order) are read with one call per run, so a restore pays one system call per run rather
        than per chunk; the rest (deduplicated chunks, chunks of older packs) are read one by
        one. Each chunk is then checked against its digest (``verify``) or only for its
        length; a device-named one on ``check_on`` (a GPU: see :func:`matches_name`), else on
        the host. ``out`` must be exactly the chunks' total length.
        """
        view = byte_view(out)
        if view.readonly:
            raise ValueError("read_chunks_into needs a writable buffer")
        runs = self.chunk_runs(digests, chunk_size, len(view), what=what)
        started = time.perf_counter()
        for path, offset, first, n in runs:
            lo, hi = first * chunk_size, min(len(view), (first + n) * chunk_size)
            try:
                got = self.backend.readinto_range(path, offset, view[lo:hi])
            except FileNotFoundError:
                # Deleted by a gc elsewhere: read chunk by chunk, which looks each one up again.
                self._forget_pack(path)
                for j in range(first, first + n):
                    self.read_chunk_into(
                        digests[j], view[j * chunk_size : min(len(view), (j + 1) * chunk_size)], what=what, verify=False
                    )
                continue
            except OSError as exc:
                raise self.read_error(exc, path, what) from exc
            if got != hi - lo:
                j = first + min(got // chunk_size, n - 1)
                raise IntegrityError(
                    f"chunk {digests[j]}{about(what)} in pack {self.backend.describe(path)} is truncated "
                    f"(read {got} of {hi - lo} bytes of its run)"
                )
        read_s = time.perf_counter() - started
        if verify:
            self.check_runs(digests, view, chunk_size, runs, what=what, check_on=check_on)
        return ChunkReads(reads=len(runs), read_s=read_s, verify_s=time.perf_counter() - started - read_s)

    def check_runs(
        self, digests: Sequence[str], view: memoryview, chunk_size: int,
        runs: Sequence[tuple[str, int, int, int]], *, what: str = "", check_on: torch.device | None = None
    ) -> None:
        """Check chunks read into ``view`` along ``runs`` (``chunk_runs``) against their
        digests; raises :class:`IntegrityError` at the first that differs. Device-named
        chunks are hashed on ``check_on`` (see :func:`matches_name`)."""
        for path, offset, first, n in runs:
            if n > 1 and chunk_size % 16 == 0 and all(is_device_name(d) for d in digests[first : first + n]):
                # one hash pass over the run: the host's nh128 costs ~0.3 ms a call before a byte
                lo, hi = first * chunk_size, min(len(view), (first + n) * chunk_size)
                got = hash_host_bytes(view[lo:hi], chunk_size, check_on, slice_bytes=CHECK_SLICE_BYTES)
                if all(h == device_hash_of(d) for h, d in zip(got, digests[first : first + n])):
                    continue
            for j in range(first, first + n):
                lo, hi = j * chunk_size, min(len(view), (j + 1) * chunk_size)
                self.check_chunk(digests[j], view[lo:hi], path, offset + (j - first) * chunk_size, hi - lo, what,
                                 check_on)

    def chunk_runs(
        self, digests: Sequence[str], chunk_size: int, nbytes: int, *, what: str = ""
    ) -> builtins.list[tuple[str, int, int, int]]:
        """Where consecutive chunks of one span (``nbytes`` in all, chunk ``j`` at ``j *
        chunk_size``) are stored: ``(pack path, pack offset, first chunk, chunks)`` per run of
        chunks stored back to back. Checks each chunk's stored length."""
        runs: builtins.list[tuple[str, int, int, int]] = []
        for j, digest in enumerate(digests):
            path, offset, length = self._locate(digest, what)
            want = min(chunk_size, nbytes - j * chunk_size)
            if length != want:
                raise IntegrityError(
                    f"chunk {digest}{about(what)} in pack {self.backend.describe(path)} is {length} bytes, "
                    f"the checkpoint expects {want}"
                )
            if runs:
                p, o, first, n = runs[-1]
                if p == path and o + (j - first) * chunk_size == offset and j == first + n:
                    runs[-1] = (p, o, first, n + 1)
                    continue
            runs.append((path, offset, j, 1))
        return runs

    def local_path(self, path: str) -> str | None:
        """The file system path of a pack, for another process to read; None when the
        backend is not a local directory."""
        local = getattr(self.backend, "local_path", None)
        return None if local is None else str(local(path))

    def read_error(self, exc: OSError, path: str, what: str) -> StorageError:
        """The :class:`StorageError` for a failed read of a chunk of ``what`` in ``path``."""
        doing = f"reading chunk for {what} from pack" if what else "reading chunk from pack"
        return storage_error(exc, doing, self.backend.describe(path), writing=False)

    def check_chunk(self, digest: str, data: bytes | memoryview, path: str, offset: int, length: int, what: str,
                    device: torch.device | None = None) -> None:
        """Raise :class:`IntegrityError` unless ``data`` (read from ``path`` at ``offset``) is
        the whole chunk ``digest``."""
        where = self.backend.describe(path)
        if len(data) != length:
            raise IntegrityError(
                f"chunk {digest}{about(what)} in pack {where} is truncated: {len(data)} of {length} bytes"
            )
        if not matches_name(digest, data, device):
            raise IntegrityError(
                f"chunk {digest}{about(what)} in pack {where} at offset {offset} does not match its digest (corrupt)"
            )


def matches_name(name: str, data: bytes | memoryview, check_on: torch.device | None = None) -> bool:
    """Whether ``data`` (a whole chunk) is the chunk ``name``: its BLAKE2b digest, or for a
    device name its device hash, computed on ``check_on`` (a GPU of the reading process: one
    copy and one launch, where the host's torch implementation costs ~10 CPU-s per GB), else
    on the host."""
    if is_device_name(name):
        return hash_host_bytes(data, max(16, -(-len(data) // 16) * 16), check_on) == [device_hash_of(name)]
    return chunk_digest(data) == name
