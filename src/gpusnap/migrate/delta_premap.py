"""The target's map of the source's bytes file, made while it waits for the handoff.

Once the target has applied a round over another (a fast handoff can land), the bytes file
the source prepared exists in the transport; the target maps it and page-locks the mapping
on a thread of its own between rounds, so that at the handoff the changed chunks go to the
device in one copy at the link's speed: no mapping, no pageable copy, in the downtime. It is
only an acceleration: a file not there yet, a mapping or page-locking refused, or one not
ready when the header comes, and the delta is read the plain way (``delta_apply._map``).
What is mapped is never trusted: the chunks are copied off it, then checked. The mapping is
read-only where the device page-locks read-only memory, else writable (CUDA page-locks only
that); nothing here writes it. A file another user made, or a link, is refused
(``open_private``); one the same user truncates under the mapping can still fault the
process (SIGBUS), as any mapped file can: the size is checked at each use, not after.

>>> premap = Premap(path, torch.device("cuda", 0))   # doctest: +SKIP
>>> view = premap.view_for(header.data, header.nbytes)  # None: not ready, or another file
>>> premap.close()                                      # doctest: +SKIP
"""

from __future__ import annotations

import logging
import mmap
import os
import threading

import torch

from gpusnap.migrate.delta_file import POPULATE, PORTABLE, READ_ONLY, lock_pages, mapped_bytes, unlock_pages, unmap
from gpusnap.storage.private_dir import open_private

__all__ = ["Premap"]

log = logging.getLogger("gpusnap")


class Premap:
    """``path`` (a bytes file of the transport, not made by this process) mapped, and
    page-locked for ``device``'s context where that is a CUDA device (portable: for every
    device), on a thread; :meth:`view_for` never waits for it. ``empty`` once the thread
    found the file not sized yet (nothing mapped: make another later)."""

    def __init__(self, path: str, device: torch.device | None) -> None:
        self.path = path
        self.name = os.path.basename(path)
        self.page_locked = False
        self.empty = False  # (the source had not sized it yet: map it again later)
        self.error: BaseException | None = None
        self._fd: int | None = None
        self._view: torch.Tensor | None = None
        self._map: mmap.mmap | None = None
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._prepare, args=(device,), name="gpusnap-migrate-premap",
                                        daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Whether the thread has finished (mapped, or not) within ``timeout``."""
        return self._ready.wait(timeout)

    def view_for(self, name: str, nbytes: int) -> tuple[torch.Tensor, bool] | None:
        """The first ``nbytes`` of the mapping and whether it is page-locked, if it is ready,
        of the file ``name`` (the one at the path now) and that large now; else None (read
        the file the plain way)."""
        if not self._ready.is_set() or name != self.name:
            return None
        with self._lock:
            view, fd = self._view, self._fd
            if self._closed or view is None or fd is None or view.numel() < nbytes:
                return None
            try:
                now, there = os.fstat(fd), os.stat(self.path, follow_symlinks=False)
            except OSError:
                return None
            if now.st_size < nbytes or (now.st_dev, now.st_ino) != (there.st_dev, there.st_ino):
                return None
            return view[:nbytes], self.page_locked

    def close(self) -> None:
        """Unlock and unmap (a view still held keeps the mapping, not the page-lock: take
        none past the delta's apply, and no copy from it may be in flight)."""
        self._thread.join()
        with self._lock:
            self._closed = True
            view, self._view = self._view, None
            mapped, self._map = self._map, None
            fd, self._fd = self._fd, None
            if view is not None and self.page_locked:
                unlock_pages(view)
        del view
        unmap(mapped)
        if fd is not None:
            os.close(fd)

    def _prepare(self, device: torch.device | None) -> None:
        fd, mapped, view, locked = None, None, None, False
        try:
            # read and write: where read-only memory cannot be page-locked, a writable mapping is
            fd = open_private(self.path, os.O_RDWR)
            size = os.fstat(fd).st_size
            if size == 0:  # (still being made by the source: try again after another round)
                self.empty = True
                return
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | POPULATE, prot=mmap.PROT_READ)
            view = mapped_bytes(mapped)
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)  # (this thread's: no context made on another device)
                locked = lock_pages(view, size, PORTABLE | READ_ONLY)
                if not locked:  # (read-only page-locking unsupported here: a writable mapping)
                    writable = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | POPULATE)
                    wview = mapped_bytes(writable)
                    if lock_pages(wview, size, PORTABLE):
                        del view
                        unmap(mapped)
                        mapped, view, locked = writable, wview, True
                    else:
                        del wview
                        unmap(writable)
                        log.info("gpusnap: migration: the handoff's bytes file could not be page-locked here: "
                                 "the delta goes to the device at pageable speed")
            with self._lock:
                if not self._closed:
                    self._fd, self._map, self._view, self.page_locked = fd, mapped, view, locked
                    fd, mapped, view, locked = None, None, None, False
        except Exception as exc:  # noqa: BLE001  (the plain read is the fallback, and says what fails)
            self.error = exc.with_traceback(None)  # (a traceback would keep this frame's mapping alive)
            log.info("gpusnap: migration: the handoff's bytes file could not be mapped ahead (%s): it is read "
                     "when the handoff comes", exc)
        finally:
            if view is not None and locked:  # (not kept: closed meanwhile, or failed)
                unlock_pages(view)
            del view
            unmap(mapped)
            if fd is not None:
                os.close(fd)
            self._ready.set()

