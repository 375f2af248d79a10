"""What ``save()`` and ``restore()`` hand back: futures with stats, and the checkpoint info."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpusnap.errors import CheckpointError

__all__ = ["CheckpointInfo", "PendingSave", "RestoreCompletion", "RestoreHandle", "SaveCompletion", "SaveWaits"]


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint.

    ``stats`` holds (seconds and bytes): ``stall_s``, ``duration_s``, ``bytes_total``,
    ``bytes_copied``, ``bytes_cow``, ``bytes_skipped``, ``validation``.
    ``tier``: ``"durable"`` (the Checkpointer's root; a promoted checkpoint lists so) or
    ``"fast"`` (only in its ``fast_root``). ``world_size``: the ranks that saved it
    together (1: a per-process checkpoint; docs/distributed.md).
    """

    id: str
    tag: str | None
    created: float
    nbytes: int
    stats: dict[str, Any] = field(default_factory=dict)
    tier: str = "durable"
    world_size: int = 1


class _Completion:
    """A one-shot result or error, settable from a background thread (the first one wins)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._value: Any = None
        self._error: BaseException | None = None

    def set(self, value: Any) -> bool:
        with self._lock:
            if self._event.is_set():
                return False
            self._value = value
            self._event.set()
            return True

    def fail(self, error: BaseException) -> bool:
        with self._lock:
            if self._event.is_set():
                return False
            self._error = error
            self._event.set()
            return True

    def done(self) -> bool:
        return self._event.is_set()

    def wait_for(self, seconds: float | None) -> bool:
        return self._event.wait(seconds)

    def error(self) -> BaseException | None:
        return self._error if self._event.is_set() else None

    def value(self) -> Any:
        return self._value if self._event.is_set() else None

    def result(self, timeout: float | None, what: str) -> Any:
        if not self._event.wait(timeout):
            raise TimeoutError(f"{what} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value


class SaveWaits(Protocol):
    """What a save's waits run besides waiting (the save path implements it)."""

    def reap(self) -> None:
        """Pop closed windows' trackers on the calling thread."""

    def wait_for(self, completion: SaveCompletion, deadline: float | None) -> None:
        """Block until ``completion`` is done or ``deadline`` (time.monotonic), running the
        calling thread's due retries meanwhile."""

    def failed(self, completion: SaveCompletion) -> None:
        """Record a failure nothing has observed yet."""


class SaveCompletion:
    """The producer side of a :class:`PendingSave`: the save path settles it (staged, then
    finished or failed) from any thread; the program reads it through ``handle``.

    It holds no reference to its handle (a handle holds it): a finished save leaves no
    reference cycle for the collector.

    >>> done = SaveCompletion("ckpt-1", None)
    >>> handle = PendingSave(done)
    >>> done.finish(CheckpointInfo("ckpt-1", None, 0.0, 0)); handle.wait().id
    'ckpt-1'
    """

    def __init__(self, checkpoint_id: str, tag: str | None, waits: SaveWaits | None = None) -> None:
        self.id = checkpoint_id
        self.tag = tag
        self.stats: dict[str, Any] = {}  # the committed save's (its handle's ``stats``)
        self._staged = _Completion()
        self._durable = _Completion()
        self._observed = False
        self._observed_lock = threading.Lock()
        self._waits = waits
        self.pid = os.getpid()  # the process whose threads finish it (not a forked child)

    # -- producer ------------------------------------------------------------------------
    def set_staged(self) -> None:
        """Every byte of the state is captured: the program may mutate it freely."""
        self._staged.set(None)

    def finish(self, info: CheckpointInfo) -> None:
        """Committed (staged too, if it was not yet)."""
        self.stats = dict(info.stats)
        self._staged.set(None)
        self._durable.set(info)

    def fail(self, error: BaseException) -> None:
        """Fail the save (once: a save already committed or failed stays as it is)."""
        if not isinstance(error, CheckpointError):
            wrapped = CheckpointError(f"checkpoint {self.id} failed: {str(error) or type(error).__name__}")
            wrapped.__cause__ = error
            error = wrapped
        self._staged.fail(error)
        if self._durable.fail(error) and self._waits is not None:
            self._waits.failed(self)

    def observe(self) -> None:
        """The program has seen the error (raised to it, or returned)."""
        with self._observed_lock:
            self._observed = True

    def observed(self) -> bool:
        return self._observed

    def claim(self) -> bool:
        """True for the first caller once the save has failed unobserved: it reports the error."""
        with self._observed_lock:
            if self._observed or self._durable.error() is None:
                return False
            self._observed = True
            return True

    # -- reader --------------------------------------------------------------------------
    def done(self) -> bool:
        return self._durable.done()

    def staged(self) -> bool:
        return self._staged.done()

    def error(self) -> BaseException | None:
        return self._durable.error()

    def info(self) -> CheckpointInfo | None:
        return self._durable.value()  # type: ignore[no-any-return]

    def wait_done(self, seconds: float | None) -> bool:
        """A plain wait (no retries run): True once done."""
        return self._durable.wait_for(seconds)

    def wait_staged(self, timeout: float | None) -> None:
        self._staged.result(timeout, f"capture of checkpoint {self.id}")

    def block(self, timeout: float | None) -> None:
        """Wait until done or ``timeout``; a save that failed validation is retried on the
        thread that saved, so the waits run that thread's due retries."""
        if os.getpid() != self.pid and not self.done():  # (no thread here would finish it)
            raise CheckpointError(
                f"checkpoint {self.id} is being saved by process {self.pid}, which this process was forked from: "
                "only that process finishes it (wait for it there)"
            )
        if self._waits is None:
            self._durable.wait_for(timeout)
            return
        self._waits.wait_for(self, None if timeout is None else time.monotonic() + timeout)

    def reap(self) -> None:
        if self._waits is not None:
            self._waits.reap()


class PendingSave:
    """A save in progress. Two moments: *staged* (state captured; the program may mutate
    freely) and *durable* (committed; :meth:`wait` returns its :class:`CheckpointInfo`).

    A failed save's error is *observed* once this handle has raised it (:meth:`wait`,
    :meth:`wait_staged`) or returned it (:meth:`exception`); :meth:`done` alone does not
    observe it. An error nothing observed is raised, once, by the Checkpointer's next
    ``wait()``, ``close()`` or ``with``-block exit, else reported on stderr at
    interpreter exit (docs/guarantees.md).

    >>> pending = ckpt.save(app_state)      # doctest: +SKIP
    >>> info = pending.wait()               # doctest: +SKIP
    """

    def __init__(self, completion: SaveCompletion) -> None:
        self.id = completion.id
        self.tag = completion.tag
        self._completion = completion

    @property
    def stats(self) -> dict[str, Any]:
        """The committed save's stats (empty until then): see :class:`CheckpointInfo`."""
        return self._completion.stats

    @stats.setter
    def stats(self, value: dict[str, Any]) -> None:
        self._completion.stats = value

    def staged(self) -> bool:
        """True once every byte of the state is captured (or the save failed)."""
        return self._completion.staged()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the state is captured; raises if capturing failed."""
        try:
            self._completion.wait_staged(timeout)
        except CheckpointError:
            self._completion.observe()
            raise
        finally:
            self._completion.reap()

    def done(self) -> bool:
        """True once the save is committed or has failed."""
        return self._completion.done()

    def wait(self, timeout: float | None = None) -> CheckpointInfo:
        """Block until durable; returns the info, or raises the save's error."""
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self._completion.info()  # type: ignore[return-value]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Block until durable like :meth:`wait`; returns the save's error (None once
        committed) instead of raising it. Either way the error counts as observed."""
        self._completion.block(timeout)
        if not self._completion.done():
            raise TimeoutError(f"checkpoint {self.id} did not finish within {timeout} s")
        error = self._completion.error()
        if error is not None:
            self._completion.observe()
        return error

    def __repr__(self) -> str:
        state = "done" if self.done() else ("staged" if self.staged() else "capturing")
        return f"PendingSave(id={self.id!r}, {state})"


class RestoreHandle:
    """A restore in progress (eager restores are complete when returned).

    ``stats`` (seconds and bytes): ``checkpoint`` (id), ``mode`` ("eager" or "lazy"),
    ``verify`` (how chunks were checked), ``threads`` (readers), ``order`` ("access": the
    order the program touched buffers in the save window; "manifest": storage order),
    ``return_s`` (until ``restore()`` returned), ``total_s`` (until every byte was in place),
    ``bytes_read``, ``chunks_read``, ``waits`` / ``wait_s`` (ops that waited for a buffer not
    yet loaded, and for how long in total), ``opaque_waits`` (CUDA graph replays, Triton or
    compiled launches that waited for everything), ``first_needed`` (key path -> seconds from
    ``restore()`` to the program's first touch of it during a lazy restore), ``skipped_newer``
    (unreadable manifests newer than the checkpoint restored: ``[{"id", "reason"}]``, each
    also named in a WARNING), ``lazy_refused`` (why a ``lazy=True`` restore ran eagerly, e.g.
    inside ``torch.inference_mode()``), ``gate_dropped`` (times a guard no gpusnap hook saw
    dropped the lazy gate's dispatch key, put back at the next gpusnap call), ``missing`` /
    ``unexpected`` (``restore(strict=False)``: dotted key paths only ``app_state``, or only
    the checkpoint, has, which were skipped; empty for a strict restore), ``source``
    (``"server"``: the restore server copied every byte, ``served`` says how; ``"files"``,
    and ``server_fallback`` says why the server did not serve; docs/serve.md).

    >>> h = ckpt.restore(app_state, lazy=True)   # doctest: +SKIP
    >>> out = model(x)                            # doctest: +SKIP
    >>> h.wait(); h.stats["first_needed"]        # doctest: +SKIP
    """

    def __init__(self, completion: RestoreCompletion) -> None:
        self.checkpoint_id = completion.checkpoint_id
        self.stats: dict[str, Any] = {"checkpoint": completion.checkpoint_id}
        self._completion = completion

    def _reap(self) -> None:
        self._completion.reap()

    def done(self) -> bool:
        """True once every byte is restored (or the restore failed)."""
        finished = self._completion.done()
        if finished:
            self._reap()
        return finished

    def wait(self, timeout: float | None = None) -> None:
        """Block until every byte is restored; raises the restore's error."""
        try:
            self._completion.result(timeout)
        finally:
            self._reap()

    def __repr__(self) -> str:
        state = "done" if self._completion.done() else "loading"
        return f"RestoreHandle({self.checkpoint_id!r}, {state})"


class RestoreCompletion:
    """The producer side of a :class:`RestoreHandle`: the restore path finishes or fails it;
    ``on_wait`` runs at each of the program's waits (it pops a finished lazy restore's gate).
    It holds no reference to its handle (a handle holds it).

    >>> done = RestoreCompletion("ckpt-1")
    >>> handle = RestoreHandle(done)
    >>> done.finish(); handle.done()
    True
    """

    def __init__(self, checkpoint_id: str, on_wait: Callable[[], None] | None = None) -> None:
        self.checkpoint_id = checkpoint_id
        self._done = _Completion()
        self._on_wait = on_wait

    def set_on_wait(self, on_wait: Callable[[], None]) -> None:
        self._on_wait = on_wait

    def finish(self) -> None:
        self._done.set(None)

    def fail(self, error: BaseException) -> None:
        self._done.fail(error)

    def done(self) -> bool:
        return self._done.done()

    def result(self, timeout: float | None) -> None:
        self._done.result(timeout, f"restore of {self.checkpoint_id}")

    def reap(self) -> None:
        if self._on_wait is not None:
            self._on_wait()
