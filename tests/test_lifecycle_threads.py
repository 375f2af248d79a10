"""Issue 21, item 11: no hang, no leak, whatever the threads and interrupts.

A retry due on a thread that will not run it fails instead of hanging a waiter elsewhere;
two waiting threads do not trip over each other or strand a tracker; Ctrl-C while save()
waits for a queue slot fails that save cleanly (window closed, tracker popped, transaction
aborted) and propagates; close() twice, from another thread, or a save() after it, behave.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from fast_support import durable_backend
from faults import FaultyBackend, tmp_files, wait_until
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import gpusnap
from gpusnap.capture import concurrent as concurrent_mod
from gpusnap.errors import CheckpointError, ValidationError
from gpusnap.storage.backend import open_backend
from gpusnap.storage.repository import Repository

CHUNK = 512
WAIT_S = 60  # only a hang reaches it


@pytest.fixture(autouse=True)
def _no_tracker_left() -> Any:
    """Every test leaves the main thread's dispatch-mode stack as it found it (empty)."""
    yield
    left = _get_current_dispatch_mode_stack()
    for mode in reversed(left):  # (so that one failure does not spread to the next tests)
        mode.__exit__(None, None, None)
    assert left == [], "a tracker stayed pushed on the main thread"


def _config(**kw: Any) -> gpusnap.Config:
    base: dict[str, Any] = {"chunk_size": CHUNK, "staging_bytes": 4 * CHUNK, "pack_size": 1 << 16,
                            "io_threads": 2, "eager_cpu_bytes": 0, "cpu_snapshot_bytes": 0, "fsync": False}
    base.update(kw)
    return gpusnap.Config(**base)


def _state() -> dict[str, torch.Tensor]:
    return {"a": torch.randn(2048), "b": torch.randn(1024), "c": torch.arange(300, dtype=torch.int64)}


@pytest.fixture
def backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FaultyBackend:
    """The storage backend of every test's root (``tmp_path / "ck"``), for faults."""
    root = tmp_path / "ck"
    return durable_backend(monkeypatch, root, FaultyBackend(open_backend(root)))


@pytest.fixture
def held(backend: FaultyBackend) -> Any:
    """Chunk stores (writes of packs) wait until released: the copier stalls with later spans
    still pending, so an unseen write to "b" after save() is copied, and fails validation."""
    gate = threading.Event()
    backend.before_write = lambda path: gate.wait(WAIT_S) if path.endswith(".pack") else None
    yield gate
    gate.set()


@pytest.fixture
def writer_gate(backend: FaultyBackend) -> Any:
    """The writer thread waits at each commit until released (saves queue up behind it)."""
    gate = threading.Event()
    backend.before_rename = lambda path: gate.wait(WAIT_S) if path.startswith("manifests/") else None
    yield gate
    gate.set()


def _inside(thread: threading.Thread, function: str, where: str = "gpusnap") -> bool:
    """Whether ``thread`` is running ``function`` (of a file whose path has ``where``) now:
    its stack, read from outside."""
    frame = sys._current_frames().get(thread.ident)  # type: ignore[arg-type]
    while frame is not None:
        if frame.f_code.co_name == function and where in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _root_is_clean(root: Path) -> None:
    assert tmp_files(root) == [], "temporary files left behind"
    assert not Repository.open(root).gc(blocking=False).skipped, "the root's lock is still held"


def _saving_thread(ck: gpusnap.Checkpointer, state: dict[str, torch.Tensor], held: threading.Event,
                   box: dict[str, Any], then: Any = None) -> threading.Thread:
    def run() -> None:
        box["pending"] = ck.save(state)
        state["b"].numpy()[3] = 99.0  # unseen: this attempt fails validation; its retry is due here
        held.set()
        if then is not None:
            then()

    return threading.Thread(target=run, name="helper")


# -- (a) a retry due on another thread ----------------------------------------------------------
def test_a_retry_due_on_a_thread_that_ended_fails_instead_of_hanging(tmp_path: Path, held: threading.Event) -> None:
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config(retry_validation=True)) as ck:
        box: dict[str, Any] = {}
        helper = _saving_thread(ck, _state(), held, box)
        helper.start()
        helper.join()
        with pytest.raises(ValidationError, match="'helper'.* had ended"):
            ck.wait(timeout=WAIT_S)  # (it waited for the retry forever: a TimeoutError)
        assert box["pending"].done() and ck.list() == []


def test_a_retry_due_on_a_thread_busy_elsewhere_fails_at_once(tmp_path: Path, held: threading.Event) -> None:
    go_on = threading.Event()
    box: dict[str, Any] = {}

    def later() -> None:  # the saving thread's next gpusnap call, long after
        go_on.wait(WAIT_S)
        box["error"] = box["pending"].exception()
        box["stack"] = _get_current_dispatch_mode_stack()

    with gpusnap.Checkpointer(tmp_path / "ck", config=_config(retry_validation=True)) as ck:
        helper = _saving_thread(ck, _state(), held, box, then=later)
        helper.start()
        try:
            assert held.wait(WAIT_S)  # saved
            with pytest.raises(ValidationError, match="'helper'.* was not waiting in gpusnap") as raised:
                ck.wait(timeout=WAIT_S)
        finally:
            go_on.set()
            helper.join()
        assert box["error"] is raised.value, "the saving thread sees the same outcome"
        assert box["stack"] == [], "the helper's tracker was popped at its next call"
        assert ck.list() == []


def test_a_retry_runs_while_its_thread_waits_and_another_waits_too(tmp_path: Path, held: threading.Event) -> None:
    saved = threading.Event()
    box: dict[str, Any] = {}

    def wait_here() -> None:
        saved.set()
        box["info"] = box["pending"].wait()

    with gpusnap.Checkpointer(tmp_path / "ck", config=_config(retry_validation=True)) as ck:
        helper = _saving_thread(ck, _state(), held, box, then=wait_here)
        helper.start()
        assert saved.wait(WAIT_S)
        # the helper is inside its wait (which runs its retries), or already through it
        wait_until(lambda: _inside(helper, "wait_for") or "info" in box, "the helper's wait")
        infos = ck.wait(timeout=WAIT_S)
        helper.join()
        assert [i.id for i in infos] == [box["info"].id] == [box["pending"].id]
        assert "a retry" in box["info"].stats["validation"]


# -- (b) two threads waiting --------------------------------------------------------------------
def test_two_threads_waiting_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config(cpu_snapshot_bytes=1 << 20)) as ck:
        state = _state()
        ck.save(state).wait()  # the first window logs reads (tracked); the next is not
        ck.save(state)
        capture = ck._saves.windows.newest()
        assert not capture.tracked
        capture.wait_captured()  # closed, still listed: both waiters find it
        both = threading.Barrier(2)
        arrived: set[str] = set()
        reap = concurrent_mod.ConcurrentSave.reap

        def reap_together(self: Any) -> bool:
            name = threading.current_thread().name
            if name.startswith("waiter") and name not in arrived:
                arrived.add(name)
                both.wait(WAIT_S)  # both have listed the window before either forgets it
            return reap(self)

        # the capture layer's own reap, on both waiting threads at once (no storage call to hold)
        monkeypatch.setattr(concurrent_mod.ConcurrentSave, "reap", reap_together)
        errors: list[BaseException] = []

        def waiter() -> None:
            try:
                ck.wait(timeout=WAIT_S)
            except BaseException as exc:
                errors.append(exc)

        waiters = [threading.Thread(target=waiter, name=f"waiter-{i}") for i in range(2)]
        for w in waiters:
            w.start()
        for w in waiters:
            w.join()
        assert errors == []
        assert ck._saves.windows.listed() == 0


def test_a_wait_on_another_thread_leaves_the_savers_tracker_to_it(tmp_path: Path) -> None:
    saved, waited = threading.Event(), threading.Event()
    box: dict[str, Any] = {}
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config()) as ck:

        def helper() -> None:
            box["pending"] = ck.save(_state())  # the first window is tracked: on this thread
            saved.set()
            waited.wait(WAIT_S)
            ck.wait()  # this thread's next gpusnap call pops it
            box["stack"] = _get_current_dispatch_mode_stack()

        thread = threading.Thread(target=helper, name="helper")
        thread.start()
        assert saved.wait(WAIT_S)
        assert [i.id for i in ck.wait(timeout=WAIT_S)] == [box["pending"].id]  # not this thread's window
        waited.set()
        thread.join()
    assert box["stack"] == [], "the tracker stayed pushed on the saving thread"


# -- (c) Ctrl-C and close() -----------------------------------------------------------------------
@pytest.fixture
def ctrl_c_raises() -> Any:
    """Ctrl-C raises KeyboardInterrupt, as in a program started from a terminal: a job a shell
    starts in the background (``cmd &``) inherits SIGINT ignored, and Python then installs
    no handler, so the signal this test sends would be dropped and the save wait on."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_while_save_waits_for_a_queue_slot(tmp_path: Path, writer_gate: threading.Event,
                                                  backend: FaultyBackend, ctrl_c_raises: None) -> None:
    root = tmp_path / "ck"
    ck = gpusnap.Checkpointer(root, config=_config(max_pending_saves=1))
    try:
        state = _state()
        gated = threading.Event()
        backend.before_rename = lambda path: (gated.set(), writer_gate.wait(WAIT_S)) if path.startswith(
            "manifests/") else None
        first = ck.save(state)  # the writer holds it
        wait_until(gated.is_set, "the first save held at its commit")
        second = ck.save(state)  # queued: the queue is full
        main = threading.main_thread()

        def ctrl_c_while_waiting_for_a_slot() -> None:  # Ctrl-C arrives while save() blocks
            wait_until(lambda: _inside(main, "enqueue") and _inside(main, "acquire", "threading"), "the third save's wait")
            signal.pthread_kill(main.ident, signal.SIGINT)  # type: ignore[arg-type]

        interrupter = threading.Thread(target=ctrl_c_while_waiting_for_a_slot)
        interrupter.start()
        with pytest.raises(KeyboardInterrupt):
            ck.save(state)
        interrupter.join()
        assert [c.id for c in ck._saves.pending()] == [first.id, second.id], "the interrupted save is forgotten"
        assert _get_current_dispatch_mode_stack() == [], "its tracker was popped"
        writer_gate.set()
        # (nothing raised: save() raised the third one's error, which counts as observed)
        assert [i.id for i in ck.wait(timeout=WAIT_S)] == [first.id, second.id]
        assert [i.id for i in ck.list()] == [first.id, second.id]
    finally:
        writer_gate.set()
        ck.close()
    _root_is_clean(root)


def test_ctrl_c_in_a_blocking_save_on_the_callers_thread_propagates(tmp_path: Path, backend: FaultyBackend) -> None:
    def interrupted(path: str) -> None:
        if path.startswith("manifests/"):  # its chunks are written; Ctrl-C at the commit
            raise KeyboardInterrupt

    backend.before_rename = interrupted
    root = tmp_path / "ck"
    with gpusnap.Checkpointer(root, config=_config()) as ck:
        with pytest.raises(KeyboardInterrupt):
            ck.save(_state(), blocking=True)  # host state: written on this thread
        assert ck.wait() == [] and ck.list() == []
    _root_is_clean(root)


def test_a_second_close_waits_for_the_first(
    tmp_path: Path, writer_gate: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    close = gpusnap.Checkpointer.close

    def close_releasing(self: gpusnap.Checkpointer) -> None:
        if threading.current_thread() is threading.main_thread():
            writer_gate.set()  # the first close() (on the other thread) can now finish
        close(self)

    monkeypatch.setattr(gpusnap.Checkpointer, "close", close_releasing)
    ck = gpusnap.Checkpointer(tmp_path / "ck", config=_config())
    pending = ck.save(_state())
    closer = threading.Thread(target=ck.close, name="closer")
    closer.start()
    wait_until(lambda: _inside(closer, "shut_down"), "the first close()")  # waiting for the held writer
    ck.close()
    assert pending.done(), "close() returned while a save was still pending"
    closer.join()
    assert [i.id for i in ck.list()] == [pending.id]
    assert _get_current_dispatch_mode_stack() == [], "this thread's tracker was popped"


def test_close_on_another_thread_then_save_raises_and_pops_the_tracker(tmp_path: Path) -> None:
    ck = gpusnap.Checkpointer(tmp_path / "ck", config=_config())
    pending = ck.save(_state())  # tracked window: its tracker is on this thread
    closer = threading.Thread(target=ck.close, name="closer")
    closer.start()
    closer.join()
    assert pending.done()
    with pytest.raises(CheckpointError, match="closed"):
        ck.save(_state())
    assert _get_current_dispatch_mode_stack() == []
    assert [i.id for i in ck.list()] == [pending.id]


def test_wait_with_a_timeout(tmp_path: Path, writer_gate: threading.Event) -> None:
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config()) as ck:
        pending = ck.save(_state())
        with pytest.raises(TimeoutError, match=pending.id):
            ck.wait(timeout=0)
        with pytest.raises(TimeoutError):
            pending.wait(timeout=0)
        writer_gate.set()
        assert [i.id for i in ck.wait(timeout=WAIT_S)] == [pending.id]
