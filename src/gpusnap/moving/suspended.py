"""A suspended state: :class:`Suspended` (the handle ``suspend`` returns) over a
:class:`Core` (what the registry keeps alive while any storage points at its host copy).

    suspended --resume()--> resumed
        \\--resume(lazy=True)--> resuming --(every storage back)--> resumed
                                    \\--(failed: the rest still suspended)--> suspended

Resuming checks each suspended storage first: one no tensor holds any more is not brought
back (``dropped_bytes``), one the program gave other memory meanwhile (``.data =`` keeps the
tensor but replaces the storage, so that case is a dropped one; an exchange by other code is
this one) is left as the program made it (``changed``, with a warning). Everything else comes
back into the same storage objects.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from gpusnap.capture.swap_guard import before_swap
from gpusnap.errors import CheckpointError
from gpusnap.moving import copies, host_memory, registry
from gpusnap.moving.host_memory import Slab
from gpusnap.moving.lazy_resume import LazyResume, reap_finished
from gpusnap.moving.members import Member
from gpusnap.moving.stats import SuspendStats
from gpusnap.moving.swap import exchange_all
from gpusnap.restore.lazy.gate import lazy_refusal

__all__ = ["Core", "Parked", "Suspended"]

log = logging.getLogger("gpusnap")

State = Literal["suspended", "resuming", "resumed"]


@dataclass(eq=False)
class Parked:
    """One suspended storage, held weakly: ``Member``'s facts without keeping it alive."""

    ref: StorageWeakRef
    key: int  # the storage's identity (_cdata) when it was suspended
    nbytes: int
    offset: int
    device: torch.device
    paths: tuple[str, ...]
    tensors: tuple[object, ...]  # weak references to the tensors on it
    pinned: bool
    address: int  # where its host copy is: its data pointer while suspended
    back: bool = False  # resumed, dropped or changed: no longer this suspension's

    def storage(self) -> torch.UntypedStorage | None:
        return torch.UntypedStorage._new_with_weak_ptr(self.ref.cdata)  # type: ignore[attr-defined]

    def member(self, storage: torch.UntypedStorage) -> Member:
        return Member(storage, self.nbytes, self.offset, self.device, self.paths, self.tensors, self.pinned)  # type: ignore[arg-type]


class Core:
    """The mutable state of one suspension, shared by its handle, its lazy resume's copy
    thread and the registry (which calls :meth:`release`)."""

    def __init__(self, parked: list[Parked], slab: Slab | None, reuse_host: bool, stats: SuspendStats) -> None:
        self.lock = threading.Lock()
        self.parked = parked
        self.parked_of = {p.key: p for p in parked}
        self.slab = slab
        self.reuse_host = reuse_host
        self.stats = stats
        self.state: State = "suspended"
        self.session: LazyResume | None = None
        self.started = 0.0  # of the running resume

    def release(self) -> None:
        """No storage points at the host copy any more: keep it for the next suspend, or let it go."""
        with self.lock:
            slab, self.slab = self.slab, None
        if slab is not None and self.reuse_host:
            host_memory.keep(slab)

    def settle(self, members: list[Member], error: BaseException | None, ended: float, waits: int,
               *, lazy: bool) -> None:
        """``members`` are back on their device (the rest, if ``error``, still suspended)."""
        for m in members:
            self.parked_of[m.storage._cdata].back = True
        with self.lock:
            left = [p for p in self.parked if not p.back]
            self.state = "suspended" if left else "resumed"
            self.stats = dataclasses.replace(
                self.stats,
                resumed_bytes=self.stats.resumed_bytes + sum(m.nbytes for m in members),
                resume_s=None if error is not None else ended - self.started,
                lazy=lazy,
                waits=waits,
            )
        if registry.remove(self, [m.storage for m in members]) and not left:
            self.release()


class Suspended:
    """The device state of ``app_state``, moved to host memory by :func:`gpusnap.suspend`.

    ``resume()`` brings the bytes back into the same tensor objects. Until then the tensors
    keep working from host memory (slowly: on CUDA over the bus), and what they write is
    what comes back. The host memory is held until every storage is resumed or dropped by
    the program, whether or not this handle is kept.

    Example::

        s = gpusnap.suspend({"model": model, "optim": optim})
        ...                      # the device memory is free for another process
        s.resume()               # or s.resume(lazy=True): ops wait only for what they touch
        print(s.stats.device_freed_bytes, s.stats.resume_s)

    As a context manager it resumes on exit::

        with gpusnap.suspend(app_state):
            run_the_other_job()
    """

    def __init__(self, core: Core) -> None:
        self._core = core

    @property
    def stats(self) -> SuspendStats:
        """Bytes, seconds and device memory freed so far (:class:`SuspendStats`)."""
        reap_finished()
        return self._core.stats

    @property
    def state(self) -> State:
        """``"suspended"``, ``"resuming"`` (a lazy resume copying) or ``"resumed"``."""
        reap_finished()
        return self._core.state

    def done(self) -> bool:
        """Whether every byte is back on its device (a lazy resume has finished)."""
        return self.state == "resumed"

    def resume(self, lazy: bool = False) -> None:
        """Bring every suspended storage back to its device, into the same storage objects.

        ``lazy=False``: returns once every byte is back. ``lazy=True``: returns once device
        memory for everything is allocated; the bytes follow from a background thread while
        the program runs, an op on this thread waiting only for the storages it touches
        (other threads: call :meth:`wait` first). Inside ``torch.inference_mode()`` or
        ``no_dispatch`` a lazy resume cannot gate ops and runs eagerly (with a warning).

        Raises ``CheckpointError`` if the state is resumed already or a lazy resume is still
        running, or if the device has no room for it (nothing changes: call again later).
        """
        core = self._core
        reap_finished()
        with core.lock:
            if core.state == "resumed":
                raise CheckpointError("resume(): this state is resumed already; suspend() it again to free its memory")
            if core.state == "resuming":
                raise CheckpointError("resume(): a lazy resume of this state is still running; wait() for it")
            core.state = "resuming"
            core.session = None  # (a failed lazy one's: its error was for the last wait())
            core.started = started = time.perf_counter()
        began = False
        try:
            members = self._collect()
            if lazy and (refused := lazy_refusal()) is not None:
                log.warning("gpusnap: resume(lazy=True) runs eagerly: %s", refused)
                lazy = False
            buffers = copies.allocate(members)
            assert core.slab is not None or not members
            if not lazy or not members:
                if members:
                    copies.to_device(members, buffers, core.slab)  # type: ignore[arg-type]
                    storages = [m.storage for m in members]
                    before_swap(storages)
                    exchange_all([(m.storage, b.untyped_storage()) for m, b in zip(members, buffers)])
                del buffers  # (now over the host copy: nothing to free)
                ended = time.perf_counter()
                core.settle(members, None, ended, 0, lazy=False)
                self._returned(ended - started)
                return
            session = LazyResume(members, buffers, core.slab, started,  # type: ignore[arg-type]
                                 lambda back, error, ended, waits: core.settle(
                                     [members[i] for i in back], error, ended, waits, lazy=True))
            del buffers
            with core.lock:
                core.session = session
            session.begin()
            began = True
            self._returned(time.perf_counter() - started)
        except BaseException:
            if not began:
                with core.lock:
                    core.state = "suspended"
                    core.session = None
            raise

    def wait(self, timeout: float | None = None) -> SuspendStats:
        """Until a lazy resume has brought every byte back (at once if none is running);
        returns the stats. Raises ``TimeoutError`` after ``timeout`` seconds, and
        ``CheckpointError`` if the lazy resume failed (what it did not bring back stays
        suspended: ``resume()`` again)."""
        session = self._core.session
        if session is not None:
            session.wait(timeout)
            reap_finished()
            if session.error is not None:
                raise CheckpointError(f"the lazy resume failed: {session.error}. What it had not brought back stays "
                                      f"suspended (and usable); call resume() again") from session.error
        return self.stats

    def __enter__(self) -> Suspended:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._core.state == "resuming":
            self.wait()
        if self._core.state == "suspended":
            self.resume()

    def __repr__(self) -> str:
        s = self._core.stats
        return f"<gpusnap.Suspended {self._core.state}: {s.storages} storages, {s.bytes} bytes>"

    # -- helpers -------------------------------------------------------------------------------
    def _collect(self) -> list[Member]:
        """The suspended storages to bring back; those dropped or changed meanwhile are settled here."""
        core = self._core
        members: list[Member] = []
        dropped = 0
        changed: list[str] = []
        gone: list[torch.UntypedStorage] = []
        for p in core.parked:
            if p.back:
                continue
            storage = p.storage()
            if storage is None:  # no tensor holds it any more
                p.back = True
                dropped += p.nbytes
            elif storage.data_ptr() != p.address or storage.nbytes() != p.nbytes:
                p.back = True
                changed.append(p.paths[0])
                gone.append(storage)
            else:
                members.append(p.member(storage))
        if changed:
            warnings.warn(f"gpusnap: resume() leaves {', '.join(changed[:4])} as the program made them: their storages "
                          f"were given other memory while suspended", RuntimeWarning, stacklevel=3)
        registry.remove(core, gone)
        with core.lock:
            core.stats = dataclasses.replace(core.stats, dropped_bytes=core.stats.dropped_bytes + dropped,
                                             changed=core.stats.changed + tuple(changed))
        return members

    def _returned(self, seconds: float) -> None:
        core = self._core
        with core.lock:
            core.stats = dataclasses.replace(core.stats, resume_return_s=seconds)
