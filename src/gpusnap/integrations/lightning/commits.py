"""Pointer bookkeeping behind ``GpusnapCheckpointIO``: one background thread that writes a
path's pointer once its checkpoint commits, and deletes the checkpoints no pointer names.

Call order (each step in the order Lightning asked for it)::

    save_checkpoint(path)   -> Commits.save()          (if nothing is at ``path``: a placeholder
                                                        first for a root that is not local)
                               -> Checkpointer.save()  (tagged with ``path``; returns at once)
                               -> (if nothing is at ``path``, a local root) a link to the
                                  manifest it commits as: it exists once the checkpoint does
                            (queued; the trainer goes on)
    thread                  -> waits for the commit, then writes the pointer unless ``path``
                               was removed since; drops what the pointer replaced and the
                               older checkpoints recorded for ``path`` (a crash's leftovers),
                               or the save itself when ``path`` was removed; a save that
                               failed takes its link or placeholder away
    remove_checkpoint(path) -> Commits.removed()       (the file goes now; its checkpoints are
                                                        dropped on the thread, in order)

The thread never calls ``wait()`` on a save before it is done: a save that failed validation
is retried on the thread that made it, at its next gpusnap call (``Commits.wait`` is one), and
a wait elsewhere would give that retry up.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import shutil
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from gpusnap.checkpointer import Checkpointer
from gpusnap.errors import CheckpointError, CheckpointNotFoundError
from gpusnap.handles import PendingSave

from .pointer import Placeholder, Pointer, link_to_manifest, manifest_link, read_pointer, write_placeholder, write_pointer
from .records import recorded_for

__all__ = ["Commits"]

log = logging.getLogger("gpusnap")

_POLL_S = 0.02  # how often the thread looks whether the save it waits for is done


@dataclass(eq=False)
class _Save:
    path: str
    checkpointer: Checkpointer
    pending: PendingSave
    handled: threading.Event = field(default_factory=threading.Event)  # its pointer written (or not due)
    wanted: bool = True  # False once its path is removed: its checkpoint is dropped, no pointer written


@dataclass(eq=False)
class _Drop:
    checkpointer: Checkpointer
    pointer: Pointer
    folder: str  # where other pointers to the same checkpoint would be


@dataclass(eq=False)
class _Sweep:
    checkpointer: Checkpointer
    path: str  # removed: every checkpoint recorded for it goes (but one a pointer still names)


class Commits:
    """The pointers of a process's ``GpusnapCheckpointIO`` plug-ins (one instance serves them
    all: a save one plug-in made is waited for by another that loads its path). Paths are
    absolute local paths."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # pointer files and the list below change under it
        self._outstanding: list[_Save] = []  # saves the thread has not finished with, in order
        self._failures: list[CheckpointError] = []  # not yet raised
        self._ops: queue.Queue[_Save | _Drop | _Sweep | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._idle = threading.Event()  # never set: the thread's pause between looks
        # a program that exits without teardown(): gpusnap has finished its saves by the time
        # atexit runs (exit_hooks.py); the pointers of those saves are written then
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- what the trainer's thread calls ------------------------------------------------------
    def save(self, path: str, checkpointer: Checkpointer, start: Callable[[], PendingSave]) -> None:
        """Save ``path`` with ``start()`` (a ``save()`` of ``checkpointer``, tagged with the
        path): when nothing is at ``path``, a link to the manifest the checkpoint will be
        committed as (a placeholder first, for a root that is not local), so that the file
        exists once the checkpoint does; its pointer is written once it commits."""
        placeholder: Placeholder | None = None
        root = checkpointer.root if "://" in checkpointer.root else os.path.abspath(checkpointer.root)
        local = "://" not in root.removeprefix("file://")
        with self._lock:
            fresh = not os.path.lexists(path)
            if fresh and not local:
                placeholder = write_placeholder(path, root)
        try:
            pending = start()
        except BaseException:
            if placeholder is not None:
                with self._lock:
                    self._take_placeholder(path)
            raise
        if fresh and local:
            with self._lock:  # (unless its pointer is there already: it committed meanwhile)
                if not os.path.lexists(path):
                    link_to_manifest(path, root, pending.id)
        save = _Save(path, checkpointer, pending)
        with self._lock:
            self._outstanding.append(save)
        self._put(save)

    def removed(self, path: str, checkpointer_for: Callable[[str], Checkpointer | None]) -> None:
        """Remove ``path`` now: a pointer or placeholder (the checkpoints recorded for the path
        are dropped in the background, each once no other pointer in its directory names it),
        a symlink (only the link), or any other file or directory (as ``TorchCheckpointIO``
        would). A save still pending for ``path`` writes no pointer. ``checkpointer_for``: the
        writer of a root, or None to leave a root this plug-in does not manage alone."""
        with self._lock:
            for save in self._outstanding:
                if save.path == path:
                    save.wanted = False
            if os.path.islink(path) or os.path.isfile(path):
                found = None if os.path.islink(path) else _quietly(path)  # (a damaged one goes too)
                os.remove(path)
            elif os.path.isdir(path):
                shutil.rmtree(path)
                return
            else:
                return
        checkpointer = None if found is None else checkpointer_for(found.root)
        if checkpointer is not None:
            if isinstance(found, Pointer):
                self._put(_Drop(checkpointer, found, os.path.dirname(path)))
            self._put(_Sweep(checkpointer, path))

    def wait_for(self, path: str) -> None:
        """Until every save of ``path`` made so far is committed and handled (its pointer
        written, or its failure noted for :meth:`raise_failure`)."""
        with self._lock:
            saves = [s for s in self._outstanding if s.path == path]
        for save in saves:
            save.pending.exception()  # (on this thread: see wait())
            save.handled.wait()

    def wait(self) -> None:
        """Every save made so far committed and its pointer written, every drop done; then
        raise the first failure not yet raised."""
        with self._lock:
            saves = list(self._outstanding)
        for save in saves:
            save.pending.exception()  # here, on the thread that saved: a due retry runs
        self._ops.join()
        self.raise_failure()

    def raise_failure(self) -> None:
        """Raise (once) the first save that failed since the last call, naming the others."""
        with self._lock:
            failures, self._failures = self._failures, []
        if failures:
            first = failures[0]
            if len(failures) > 1:
                others = "; ".join(str(f) for f in failures[1:])
                raise CheckpointError(f"{first} (and {len(failures) - 1} more: {others})") from first.__cause__
            raise first

    def close(self) -> None:
        """:meth:`wait`, then stop the thread (a later save starts another); at exit."""
        try:
            self.wait()
        finally:
            if self._thread is not None:
                self._ops.put(None)
                self._thread.join()
                self._thread = None

    # -- the thread ---------------------------------------------------------------------------
    def _put(self, op: _Save | _Drop | _Sweep) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="gpusnap-lightning-pointers", daemon=True)
            self._thread.start()
        self._ops.put(op)

    def _run(self) -> None:
        while True:
            op = self._ops.get()
            try:
                if op is None:
                    return
                if isinstance(op, _Save):
                    self._commit(op)
                elif isinstance(op, _Sweep):
                    self._sweep(op.checkpointer, op.path, keep=None)
                else:
                    self._drop(op)
            except Exception as exc:  # (an unexpected one: a folder gone, say): raised to the trainer
                self._fail(f"checkpoint bookkeeping failed ({type(exc).__name__})", exc)
            finally:
                self._ops.task_done()

    def _commit(self, save: _Save) -> None:
        while not save.pending.done():
            self._idle.wait(_POLL_S)
        error = save.pending.exception()
        committed = error is None
        root, checkpoint = os.path.abspath(save.checkpointer.root), save.pending.id
        replaced: Pointer | Placeholder | None = None
        try:
            with self._lock:
                wanted = save.wanted
                if committed and wanted:  # (a newer save of the path still pending replaces it in turn)
                    if os.path.isfile(save.path) and not os.path.islink(save.path):
                        replaced = _quietly(save.path)  # (a link's target belongs to another path)
                    try:
                        write_pointer(save.path, Pointer(root, checkpoint))
                    except OSError as exc:
                        error = exc
                elif not committed and wanted and not any(
                        s.path == save.path and s.wanted for s in self._outstanding if s is not save):
                    self._take_placeholder(save.path, checkpoint)  # (nothing committed for it: nothing there)
        finally:
            with self._lock:
                self._outstanding.remove(save)
            save.handled.set()
        if error is not None:
            self._fail(f"checkpoint {checkpoint} for {save.path} is committed, but its pointer file could not be "
                       "written there (loading the path finds the checkpoint in the root all the same)" if committed
                       else f"the checkpoint for {save.path} failed, and no pointer was written there", error)
            return
        folder = os.path.dirname(save.path)
        if not wanted:  # the path was removed while it was saved
            self._drop(_Drop(save.checkpointer, Pointer(root, checkpoint), folder))
            return
        if isinstance(replaced, Pointer) and replaced.root == root and replaced.checkpoint != checkpoint:
            self._drop(_Drop(save.checkpointer, replaced, folder))
        self._sweep(save.checkpointer, save.path, keep=checkpoint)

    def _sweep(self, checkpointer: Checkpointer, path: str, keep: str | None) -> None:
        """Drop the checkpoints recorded for ``path`` but ``keep`` and those still being saved
        (what the pointers replaced, a crash left behind, or a removal leaves)."""
        try:
            infos = checkpointer.list()
        except Exception as exc:  # (like a failed drop: space only)
            log.warning("gpusnap: could not list %s to free the checkpoints of %s: %s", checkpointer.root, path, exc)
            return
        with self._lock:
            busy = {s.pending.id for s in self._outstanding}
        root, folder = os.path.abspath(checkpointer.root), os.path.dirname(path)
        for _created, cid in recorded_for(path, root, ((i.id, i.tag, i.created) for i in infos)):
            if cid != keep and cid not in busy:
                self._drop(_Drop(checkpointer, Pointer(root, cid), folder))

    def _take_placeholder(self, path: str, failed: str | None = None) -> None:
        """Remove the placeholder at ``path``, or the link to ``failed``'s manifest, if that is
        what is there (under the lock)."""
        linked = manifest_link(path)
        if linked is not None:
            if linked.checkpoint == failed:
                os.remove(path)
        elif not os.path.islink(path) and isinstance(_quietly(path), Placeholder):
            os.remove(path)

    def _drop(self, drop: _Drop) -> None:
        """Delete a checkpoint no pointer in ``drop.folder`` names any more (a copy of a
        pointer keeps it). Like retention, a failure is a WARNING: nothing is lost but space."""
        if _named_in(drop.folder, drop.pointer):
            return
        try:
            drop.checkpointer.delete(drop.pointer.checkpoint)
        except CheckpointNotFoundError:
            pass  # (deleted already: a pointer copied elsewhere and removed there)
        except Exception as exc:
            log.warning("gpusnap: could not delete checkpoint %s from %s (its space is not freed): %s",
                        drop.pointer.checkpoint, drop.pointer.root, exc)

    def _fail(self, what: str, error: BaseException) -> None:
        failure = CheckpointError(f"gpusnap: {what}: {error}")
        failure.__cause__ = error
        with self._lock:
            self._failures.append(failure)


def _close_at_exit(ref: weakref.ref[Commits]) -> None:
    commits = ref()
    if commits is None:
        return
    try:
        commits.close()
    except Exception as exc:  # an exit hook must not raise: say what was lost
        print(f"gpusnap: at exit, a Lightning checkpoint was not completed: {exc}", file=sys.stderr, flush=True)


def _quietly(path: str) -> Pointer | Placeholder | None:
    try:
        return read_pointer(path)
    except (OSError, CheckpointError):
        return None


def _named_in(folder: str, pointer: Pointer) -> bool:
    """Whether a pointer file in ``folder`` (not a link: links follow their target) names it."""
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return False
    return any(
        not e.is_symlink() and e.is_file() and _quietly(e.path) == pointer for e in entries
    )
