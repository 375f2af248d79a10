"""A file written with O_DIRECT: large aligned writes straight from the caller's memory.

A write through the page cache costs the host a copy of every byte (into the cache, before
write-back); with O_DIRECT the device reads the caller's pages itself, so a durable save
takes almost no host CPU. The price is alignment: each write's file offset, length and
memory address must be multiples of the block size (:data:`BLOCK`, enough for any device).

:meth:`DirectFile.append` keeps that from its callers. A piece whose memory is aligned and
at least :data:`DIRECT_MIN` long starts at the next block boundary (the gap zero-filled) and
its whole blocks go straight from its memory; every other byte is copied into an aligned
staging buffer right after its predecessor and written a block multiple at a time. So small
pieces pack tightly, and aligned pieces of whole blocks appended in turn lie back to back.

Call order: ``DirectFile.open(path)`` -> ``append(data)``\\* (each returns its bytes' offset)
-> ``finish(sync=...)`` (writes the staged tail, cuts the file to :attr:`~DirectFile.size`,
closes); or ``close()`` to drop it unfinished (the caller removes the file).

Where the file system refuses O_DIRECT (EINVAL at the open or at a first probing write: tmpfs
before Linux 6.6, some FUSE and network file systems), the file is written buffered, with no
padding at all, and :attr:`~DirectFile.direct` is False: no warning, callers report it.
"""

from __future__ import annotations

import errno
import mmap
import os

import numpy as np

from gpusnap.storage.private_dir import open_private

__all__ = ["BLOCK", "DIRECT_MIN", "DirectFile"]

BLOCK = 4096
DIRECT_MIN = 64 * 1024  # smaller pieces are copied: a gap before them would cost > 1/16 of their size
_STAGE = 8 * 1024 * 1024  # the staging buffer (a multiple of BLOCK: a full one is written as is)
_PIECE = 64 * 1024 * 1024  # at most per pwrite
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # (Linux; elsewhere every file is buffered)
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


def _round_up(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def _address(view: memoryview) -> int:
    # numpy reads the address of read-only buffers too (ctypes.from_buffer wants writable ones)
    return int(np.frombuffer(view, np.uint8).ctypes.data)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """pwrite all of ``view`` at ``offset`` in pieces, on after short writes (the GIL is released)."""
    while len(view):
        written = os.pwrite(fd, view[:_PIECE], offset)
        if written <= 0:
            raise OSError(errno.EIO, f"pwrite wrote nothing at offset {offset}")
        view, offset = view[written:], offset + written


class DirectFile:
    """An open file of a private directory (0600, no link followed), appended to as the
    module docstring says. Not thread-safe: one writer at a time."""

    def __init__(self, fd: int, path: str, *, direct: bool) -> None:
        self.path = path
        self.direct = direct  # written with O_DIRECT (False: buffered, the file system refused it)
        self.size = 0  # the logical size: end of the last piece appended
        self._fd: int | None = fd
        try:
            self._stage: mmap.mmap | None = mmap.mmap(-1, _STAGE) if direct else None  # page-aligned
        except BaseException:
            os.close(fd)
            raise
        self._view = memoryview(self._stage) if self._stage is not None else memoryview(b"")
        self._staged_at = 0  # file offset of the staging buffer's first byte (block-aligned)
        self._fill = 0  # bytes staged: direct mode keeps _staged_at + _fill == size

    @classmethod
    def open(cls, path: str) -> DirectFile:
        """Create (truncate) ``path`` for writing, with O_DIRECT where its file system takes it."""
        file = cls._open_direct(path) if _O_DIRECT else None
        return file if file is not None else cls(open_private(path, _FLAGS), path, direct=False)

    @classmethod
    def _open_direct(cls, path: str) -> DirectFile | None:
        """The file opened with O_DIRECT; None where its file system refuses it (EINVAL)."""
        try:
            file = cls(open_private(path, _FLAGS | _O_DIRECT), path, direct=True)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return None
            raise
        try:
            # some file systems take the flag and refuse the first write: learn it while nothing
            # is written (this zero block is overwritten or cut off later)
            _pwrite_all(file._fd_open(), file._view[:BLOCK], 0)
        except BaseException as exc:
            file.close()
            if isinstance(exc, OSError) and exc.errno == errno.EINVAL:
                return None
            raise
        return file

    def _fd_open(self) -> int:
        if self._fd is None:
            raise ValueError(f"write to a closed file {self.path}")
        return self._fd

    def append(self, data: bytes | bytearray | memoryview) -> int:
        """Write ``data`` after what was appended before; returns the offset it starts at.

        A piece shorter than :data:`DIRECT_MIN` always starts exactly at the previous
        :attr:`size`. The caller's memory is not used after this returns.
        """
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        fd, offset = self._fd_open(), self.size
        if not self.direct:
            _pwrite_all(fd, view, offset)
        elif len(view) >= DIRECT_MIN and _address(view) % BLOCK == 0:
            self._flush_padded()
            offset = self._staged_at
            body = len(view) - len(view) % BLOCK
            _pwrite_all(fd, view[:body], offset)
            self._staged_at += body
            self._copy(view[body:])
        else:
            self._copy(view)
        self.size = offset + len(view)
        return offset

    def _copy(self, view: memoryview) -> None:
        fd = self._fd_open()
        while len(view):
            k = min(len(view), _STAGE - self._fill)
            self._view[self._fill : self._fill + k] = view[:k]
            self._fill += k
            view = view[k:]
            if self._fill == _STAGE:
                _pwrite_all(fd, self._view, self._staged_at)
                self._staged_at += _STAGE
                self._fill = 0

    def _flush_padded(self) -> None:
        """Write the staged bytes zero-padded to a block; the next piece starts at a block boundary."""
        if not self._fill:
            return
        padded = _round_up(self._fill)
        self._view[self._fill : padded] = bytes(padded - self._fill)
        _pwrite_all(self._fd_open(), self._view[:padded], self._staged_at)
        self._staged_at += padded
        self._fill = 0

    def finish(self, *, sync: bool) -> None:
        """Write what is staged, cut the file to :attr:`size`, fsync if ``sync``, and close."""
        fd = self._fd_open()
        try:
            if self.direct:
                self._flush_padded()
                os.ftruncate(fd, self.size)  # (the last block's padding, or the probe block)
            if sync:
                os.fsync(fd)
        finally:
            self.close()

    def close(self) -> None:
        """Close without writing what is staged (the caller removes the file); again: nothing."""
        fd, self._fd = self._fd, None
        stage, self._stage = self._stage, None
        if stage is not None:
            self._view.release()
            try:
                stage.close()
            except BufferError:
                pass  # a slice of it lives on (in a traceback): the mapping goes with the slice
        if fd is not None:
            os.close(fd)
