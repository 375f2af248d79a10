"""The fast handoff's two files in a local transport: the changed chunks' bytes, in a file
the source prepared while it ran, and their header, which commits them.

Layout (beside transport.py's files)::

    ROOT/migrate/handoff-<token>.bin    the bytes: one run of changed chunks after another
    ROOT/migrate/handoff.json           the header (:class:`DeltaHeader`), renamed into place

The bytes file is made at the first ``precopy()`` on a thread of its own (allocated, mapped
and, where CUDA is up, page-locked for the device), so that at the handoff the device copies
the changed chunks straight into memory the target can map: no file write, no staging. The
header names the round the delta applies to (``base``), every run's span, bytes and place in
the file, a digest per chunk (the device hash for a CUDA span, BLAKE2b-128 for a CPU one:
the target checks every chunk before it writes a byte) and the state's tree (plain values).
A header that cannot be parsed, or names a file or ranges outside the transport, is refused.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpusnap.errors import CheckpointError
from gpusnap.migrate.transport import DELTA_HEADER
from gpusnap.storage.private_dir import open_private

__all__ = ["ALIGN", "DELTA_HEADER", "DeltaBuffer", "DeltaHeader", "DeltaRun", "buffer_name", "capacity_for",
           "is_buffer_name", "lock_pages", "mapped_bytes", "unlock_pages", "unmap"]

log = logging.getLogger("gpusnap")

ALIGN = 512  # each run's place in the file (the device hash reads 16-byte aligned starts)
_NAME = re.compile(r"^handoff-[0-9a-f]{16}\.bin$")
_KINDS = ("nh", "b2")  # the device hash, BLAKE2b-128
FORMAT = "gpusnap-migrate-delta"

# How many bytes a fast handoff may move: a share of the state (a serving step dirties the
# KV cache's tail and nothing else), within bounds; a larger delta takes the general way
CAPACITY_SHARE = 32
CAPACITY_MIN = 64 << 20
CAPACITY_MAX = 1 << 30


def capacity_for(span_bytes: list[int], chunk_size: int, free_bytes: int) -> int:
    """The bytes file's size for a state of spans of ``span_bytes``: a share of the state
    within bounds, never more than its largest delta (every chunk, each run aligned), and
    never more than what leaves the rounds room in the transport's file system
    (``free_bytes``: up to three rounds, a state's worth each, live there). 0: no room."""
    total = sum(span_bytes)
    largest = sum(n + ALIGN * -(-n // chunk_size) for n in span_bytes)
    share = max(CAPACITY_MIN, min(CAPACITY_MAX, total // CAPACITY_SHARE))
    return max(0, min(share, largest, free_bytes - 3 * total))


def mapped_bytes(mapped: mmap.mmap) -> torch.Tensor:
    """A uint8 CPU tensor over ``mapped`` that keeps the mapping alive (through NumPy, which
    holds the buffer: ``mapped.close()`` then refuses while a view lives, and the memory is
    unmapped only once none does; ``torch.frombuffer`` holds nothing, so a view could
    outlive the mapping). A read-only mapping gives a tensor nothing may write."""
    array = np.frombuffer(mapped, dtype=np.uint8)
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():  # (torch warns of read-only arrays: nothing writes this one)
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


POPULATE = getattr(mmap, "MAP_POPULATE", 0)
PORTABLE, READ_ONLY = 1, 8  # cudaHostRegisterPortable (locked for every device's context), ...ReadOnly


def lock_pages(view: torch.Tensor, nbytes: int, flags: int = PORTABLE) -> bool:
    """Page-lock the first ``nbytes`` of a mapping's ``view`` for CUDA; whether it took."""
    return int(torch.cuda.cudart().cudaHostRegister(view.data_ptr(), nbytes, flags)) == 0


def unlock_pages(view: torch.Tensor) -> None:
    """Undo :func:`lock_pages` (a context already torn down at exit: nothing to undo)."""
    try:
        torch.cuda.cudart().cudaHostUnregister(view.data_ptr())
    except Exception:  # noqa: BLE001
        pass


def unmap(mapped: mmap.mmap | None) -> None:
    """Close ``mapped``; while a view of it lives the mapping goes with the last one."""
    if mapped is not None:
        try:
            mapped.close()
        except BufferError:
            pass


def buffer_name(token: str) -> str:
    return f"handoff-{token}.bin"


def is_buffer_name(name: str) -> bool:
    """Whether ``name`` is a bytes file's name (a token from a file is checked with it)."""
    return _NAME.fullmatch(name) is not None


@dataclass(frozen=True)
class DeltaRun:
    """Bytes ``[start, stop)`` of span ``span`` at ``offset`` of the bytes file; ``kind`` of
    digest (``"nh"`` device hash, ``"b2"`` BLAKE2b-128), one per chunk in ``digests``."""

    span: int
    start: int
    stop: int
    offset: int
    kind: str
    digests: tuple[str, ...]


@dataclass(frozen=True)
class DeltaHeader:
    """What a fast handoff moved: see the module docstring."""

    token: str
    base: str
    seq: int
    chunk_size: int
    spans: tuple[int, ...]
    runs: tuple[DeltaRun, ...]
    tree: dict[str, Any]
    data: str
    nbytes: int

    def to_doc(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": 1, "token": self.token, "base": self.base, "seq": self.seq,
                "chunk_size": self.chunk_size, "spans": list(self.spans), "data": self.data, "nbytes": self.nbytes,
                "runs": [[r.span, r.start, r.stop, r.offset, r.kind, list(r.digests)] for r in self.runs],
                "tree": self.tree}

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> DeltaHeader:
        """The header in ``doc``; CheckpointError saying what is wrong with it."""
        try:
            if doc.get("format") != FORMAT or doc.get("version") != 1:
                raise ValueError(f"not a version 1 {FORMAT} header")
            spans = tuple(_nat(n) for n in doc["spans"])
            cs = _nat(doc["chunk_size"])
            nbytes = _nat(doc["nbytes"])
            data = doc["data"]
            if not isinstance(data, str) or not _NAME.fullmatch(data):
                raise ValueError(f"data file {data!r} is not a handoff-<token>.bin of the transport")
            runs = []
            for row in doc["runs"]:
                span, start, stop, offset, kind, digests = row
                span, start, stop, offset = _nat(span), _nat(start), _nat(stop), _nat(offset)
                if cs == 0 or span >= len(spans) or not start < stop <= spans[span] or start % cs:
                    raise ValueError(f"run {row[:4]} lies outside its span")
                if offset + (stop - start) > nbytes:
                    raise ValueError(f"run {row[:4]} lies outside the data ({nbytes} bytes)")
                if kind not in _KINDS or not isinstance(digests, list) or len(digests) != -(-(stop - start) // cs) \
                        or not all(isinstance(d, str) and len(d) == 32 for d in digests):
                    raise ValueError(f"run {row[:4]}: its digests do not match its chunks")
                runs.append(DeltaRun(span, start, stop, offset, kind, tuple(digests)))
            tree = doc["tree"]
            if not isinstance(tree, dict):
                raise ValueError("tree is not an object")
            token, base, seq = doc["token"], doc["base"], _nat(doc["seq"])
            if not isinstance(token, str) or not isinstance(base, str):
                raise ValueError("token and base must be strings")
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"the handoff header {DELTA_HEADER} is damaged: {exc}") from None
        return cls(token, base, seq, cs, spans, tuple(runs), tree, data, nbytes)


def _nat(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{value!r} is not a natural number")
    return value


class DeltaBuffer:
    """The source's bytes file (see the module docstring), ``capacity`` bytes at ``path``,
    prepared on a thread (:meth:`wait_ready`); ``view`` is a uint8 CPU tensor over it.
    ``page_locked``: registered with CUDA (device copies into it run at full speed)."""

    def __init__(self, path: str, capacity: int, *, page_lock: torch.device | None) -> None:
        """``page_lock``: the CUDA device whose copies fill it (None: not page-locked)."""
        self.path = path
        self.capacity = capacity
        self.page_locked = False
        self.view: torch.Tensor | None = None
        self.error: BaseException | None = None
        self._map: mmap.mmap | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._prepare, args=(page_lock,), name="gpusnap-migrate-buffer",
                                        daemon=True)
        self._thread.start()

    def wait_ready(self) -> bool:
        """Whether the file is ready to take the delta (waits for its preparation)."""
        self._thread.join()
        return self.view is not None and self.error is None

    def flush(self, nbytes: int) -> None:
        """Write the first ``nbytes`` back to the file (a no-op on tmpfs; another host reading
        a shared file system sees them then)."""
        mapped = self._map
        if mapped is not None and nbytes:
            mapped.flush(0, min(self.capacity, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE))

    def close(self, *, remove: bool = False) -> None:
        """Unmap; ``remove``: delete the file too (no delta in it for a target: it would hold
        host memory until the transport goes)."""
        self._thread.join()
        with self._lock:
            self._closed = True
            view, self.view = self.view, None
            if view is not None and self.page_locked:
                unlock_pages(view)
            del view
            mapped, self._map = self._map, None
        unmap(mapped)
        if remove:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def _prepare(self, page_lock: torch.device | None) -> None:
        try:
            fd = open_private(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            try:
                os.posix_fallocate(fd, 0, self.capacity)  # (tmpfs: the pages now, not at the handoff)
                mapped = mmap.mmap(fd, self.capacity, flags=mmap.MAP_SHARED | POPULATE)
            finally:
                os.close(fd)
            view = mapped_bytes(mapped)
            locked = False
            if page_lock is not None:
                torch.cuda.set_device(page_lock)  # (this thread's: no context made on another device)
                locked = lock_pages(view, self.capacity)  # (portable: whichever device copies into it)
                if not locked:
                    log.info("gpusnap: migration: the handoff buffer could not be page-locked: device copies "
                             "into it run at pageable speed")
            with self._lock:
                if self._closed:  # (closed while preparing)
                    if locked:
                        unlock_pages(view)
                    del view
                    unmap(mapped)
                    return
                self._map, self.view, self.page_locked = mapped, view, locked
        except Exception as exc:  # noqa: BLE001  (the handoff goes the general way; said there)
            self.error = exc
