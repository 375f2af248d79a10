"""The target's map of the source's bytes file, made while it waits for the handoff.

Once the target has applied a round over another (a fast handoff can land), the bytes file
the source prepared exists in the transport; the target maps it and page-locks the mapping
on a thread of its own between rounds, so that at the handoff the changed chunks go to the
device in one copy at the link's speed: no mapping, no pageable copy, in the downtime. It is
only an acceleration: a file not there yet, a mapping or page-locking refused, or one not
ready when the header comes, and the delta is read the plain way (``delta_apply._map``).
What is mapped is never trusted: the chunks are copied off it, then checked.

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

from gpusnap.migrate.delta_file import mapped_bytes
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
        of the file ``name`` and that large; else None (read the file the plain way)."""
        if not self._ready.is_set() or name != self.name:
            return None
        with self._lock:
            view = self._view
            if self._closed or view is None or view.numel() < nbytes:
                return None
            return view[:nbytes], self.page_locked

    def close(self) -> None:
        """Unlock and unmap (a view still held keeps the mapping, not the page-lock: take
        none past the delta's apply)."""
        self._thread.join()
        with self._lock:
            self._closed = True
            view, self._view = self._view, None
            if view is not None and self.page_locked:
                try:
                    torch.cuda.cudart().cudaHostUnregister(view.data_ptr())
                except Exception:  # noqa: BLE001  (a context already torn down: the process is ending)
                    pass
            del view
            mapped, self._map = self._map, None
        if mapped is not None:
            try:
                mapped.close()
            except BufferError:  # (a view of it still lives: the mapping goes with it)
                pass

    def _prepare(self, device: torch.device | None) -> None:
        try:
            # read and write: a mapping CUDA page-locks must be writable (nothing here writes it)
            fd = open_private(self.path, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                if size == 0:  # (still being made by the source: try again at the next round)
                    self.empty = True
                    return
                mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            finally:
                os.close(fd)
            view = mapped_bytes(mapped)
            locked = False
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)  # (this thread's: no context made on another device)
                locked = int(torch.cuda.cudart().cudaHostRegister(view.data_ptr(), size, 1)) == 0
            with self._lock:
                if self._closed:
                    if locked:
                        torch.cuda.cudart().cudaHostUnregister(view.data_ptr())
                    del view
                    try:
                        mapped.close()
                    except BufferError:
                        pass
                    return
                self._map, self._view, self.page_locked = mapped, view, locked
        except Exception as exc:  # noqa: BLE001  (the plain read is the fallback; said at debug level)
            self.error = exc
            log.debug("gpusnap: migration: the handoff's bytes file could not be mapped ahead: %s", exc)
        finally:
            self._ready.set()
