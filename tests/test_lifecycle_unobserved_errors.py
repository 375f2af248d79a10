"""Issue 21, item 7: a failed save is never silent.

An error nothing has observed through its PendingSave is raised (once) by the next
wait(), close() or with-block exit (not by the next save(), which may succeed); a with block that raises itself keeps its exception and
names the failed save in a note; saves pending at interpreter exit are finished, and a failure
nothing observed is reported on stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from faults import FaultyBackend

import gpusnap
from gpusnap.errors import StorageError
from gpusnap.storage.backend import LocalBackend
from gpusnap.storage.repository import Repository

TESTS = Path(__file__).resolve().parent


def _config(**kw: Any) -> gpusnap.Config:
    base: dict[str, Any] = {"chunk_size": 512, "staging_bytes": 8 * 512, "pack_size": 1 << 16,
                            "io_threads": 2, "fsync": False}
    base.update(kw)
    return gpusnap.Config(**base)


class _Faulty(FaultyBackend):
    def __getattr__(self, name: str) -> Any:  # what FaultyBackend does not wrap goes through as is
        return getattr(self.inner, name)


@pytest.fixture
def full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, FaultyBackend]:
    """A root whose disk is full: every save fails with ENOSPC in the background."""
    root = tmp_path / "ck"
    Repository.open(root, create=True)
    backend = _Faulty(LocalBackend(root))
    backend.write_budget = 0
    real_open = Repository.open.__func__  # type: ignore[attr-defined]

    def open_faulty(cls: type[Repository], where: Any, **kw: Any) -> Repository:
        if Path(str(where)) == root:
            kw["backend"] = backend
        return real_open(cls, where, **kw)

    monkeypatch.setattr(Repository, "open", classmethod(open_faulty))
    return root, backend


def _state() -> dict[str, Any]:
    return {"w": torch.randn(4096), "step": 3}


def _finished(ck: gpusnap.Checkpointer, pending: gpusnap.PendingSave) -> None:
    """Until the writer is done with ``pending`` (as a program that goes on without asking
    would find it), without observing its outcome."""
    deadline = time.monotonic() + 60
    while not pending.done() or pending.id in [c.id for c in ck._saves.pending()]:
        assert time.monotonic() < deadline, "the save never finished"
        time.sleep(0.001)


def _notes(error: BaseException) -> str:
    return "\n".join(getattr(error, "__notes__", ()))


def test_a_with_block_raises_a_failed_save_nobody_waited_for(full_disk: tuple[Path, FaultyBackend]) -> None:
    root, _ = full_disk
    with pytest.raises(StorageError, match="No space left") as raised:
        with gpusnap.Checkpointer(root, config=_config()) as ck:
            pending = ck.save(_state())
    assert pending.id in _notes(raised.value) and "close()" in _notes(raised.value)


def test_wait_raises_it_once(full_disk: tuple[Path, FaultyBackend]) -> None:
    root, _ = full_disk
    with gpusnap.Checkpointer(root, config=_config()) as ck:
        pending = ck.save(_state())
        _finished(ck, pending)  # no longer pending: only the record of unobserved failures has it
        with pytest.raises(StorageError, match="No space left") as raised:
            ck.wait()
        assert pending.id in _notes(raised.value)
        assert ck.wait() == []  # once
    # ... and the with block's exit does not raise it again


def test_done_alone_does_not_observe_it(full_disk: tuple[Path, FaultyBackend]) -> None:
    root, _ = full_disk
    ck = gpusnap.Checkpointer(root, config=_config())
    pending = ck.save(_state())
    _finished(ck, pending)
    assert pending.done()
    with pytest.raises(StorageError, match="No space left"):
        ck.close()
    ck.close()  # once


@pytest.mark.parametrize("how", ["wait", "exception", "wait_staged"])
def test_an_error_observed_through_its_pending_is_not_raised_again(
    full_disk: tuple[Path, FaultyBackend], how: str
) -> None:
    root, _ = full_disk
    with gpusnap.Checkpointer(root, config=_config()) as ck:
        pending = ck.save(_state())
        if how == "exception":
            error = pending.exception()
            assert isinstance(error, StorageError) and "No space left" in str(error)
        else:
            with pytest.raises(StorageError):
                getattr(pending, how)()
        _finished(ck, pending)
        assert ck.wait() == []
        with pytest.raises(StorageError):
            pending.wait()  # its own handle raises it whenever asked, like a future


def test_the_next_save_goes_on_and_wait_raises_the_earlier_failure(full_disk: tuple[Path, FaultyBackend]) -> None:
    root, backend = full_disk
    with gpusnap.Checkpointer(root, config=_config()) as ck:
        failed = ck.save(_state())
        _finished(ck, failed)
        backend.write_budget = None
        info = ck.save(_state()).wait()  # space is back: this save commits
        assert [i.id for i in ck.list()] == [info.id]
        with pytest.raises(StorageError, match="No space left") as raised:
            ck.wait()
        assert failed.id in _notes(raised.value) and "wait()" in _notes(raised.value)
        assert ck.wait() == [], "raised once"


def test_several_failures_are_raised_once_together(
    full_disk: tuple[Path, FaultyBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, backend = full_disk
    gate = threading.Event()
    backend.before_write = lambda path: gate.wait(60)  # every save is queued before the first one fails

    # (staging for a whole state: each window closes while its stores wait)
    with gpusnap.Checkpointer(root, config=_config(max_pending_saves=3, staging_bytes=1 << 16)) as ck:
        saves = [ck.save(_state()) for _ in range(3)]
        gate.set()
        with pytest.raises(StorageError, match="No space left") as raised:
            ck.wait()
        notes = _notes(raised.value)
        assert all(p.id in notes for p in saves), notes
        assert ck.wait() == []


def test_a_with_block_that_raises_keeps_its_exception_and_names_the_failed_save(
    full_disk: tuple[Path, FaultyBackend],
) -> None:
    root, _ = full_disk
    with pytest.raises(ValueError, match="the program's own error") as raised:
        with gpusnap.Checkpointer(root, config=_config()) as ck:
            pending = ck.save(_state())
            _finished(ck, pending)
            raise ValueError("the program's own error")
    notes = _notes(raised.value)
    assert pending.id in notes and "No space left" in notes, notes


def test_a_failed_blocking_save_raises_from_save_only(full_disk: tuple[Path, FaultyBackend]) -> None:
    root, _ = full_disk
    with gpusnap.Checkpointer(root, config=_config()) as ck:
        with pytest.raises(StorageError, match="No space left"):
            ck.save(_state(), blocking=True)
        assert ck.wait() == []
        ck.save({"step": 1}, blocking=False)  # (nothing left to raise)
        with pytest.raises(StorageError):
            ck.wait()  # ... but this one failed too


def _run_script(body: str, *args: str) -> subprocess.CompletedProcess[str]:
    script = textwrap.dedent(body)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          env=env, timeout=300, check=False)


_SMALL = "gpusnap.Config(chunk_size=512, staging_bytes=8 * 512, pack_size=1 << 16, io_threads=2, fsync=False)"


def test_a_script_that_ends_with_a_pending_save_commits_it(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    done = _run_script(f"""
        import sys, torch, gpusnap
        ck = gpusnap.Checkpointer(sys.argv[1], config={_SMALL})
        pending = ck.save({{"w": torch.arange(100_000, dtype=torch.float32), "step": 7}})
        print(pending.id)
        # the script ends here: no wait(), no close()
    """, str(root))
    assert done.returncode == 0, done.stderr
    saved = done.stdout.split()[-1]
    assert [m.id for m in Repository.open(root).list()] == [saved], done.stderr
    target = {"w": torch.zeros(100_000), "step": 0}
    with gpusnap.Checkpointer(root) as ck:
        ck.restore(target)
    assert target["step"] == 7 and torch.equal(target["w"], torch.arange(100_000, dtype=torch.float32))


_FAILING = """
    import sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    import torch, gpusnap
    from test_lifecycle_unobserved_errors import _Faulty
    from gpusnap.storage.backend import LocalBackend
    from gpusnap.storage.repository import Repository

    root = Path(sys.argv[1])
    Repository.open(root, create=True)
    backend = _Faulty(LocalBackend(root))
    backend.write_budget = 0  # a full disk
    real_open = Repository.open.__func__
    Repository.open = classmethod(lambda cls, where, **kw: real_open(cls, where, **{{**kw, "backend": backend}}))
    state = {{"w": torch.randn(4096), "step": 1}}
    ck = gpusnap.Checkpointer(root, config=%s)
    {use}
"""


@pytest.mark.parametrize("use", ["with", "plain"])
def test_a_script_whose_save_fails_says_so(tmp_path: Path, use: str) -> None:
    body = {
        "with": "with ck:\n        print(ck.save(state).id)",
        "plain": "print(ck.save(state).id)  # and the script ends",
    }[use]
    done = _run_script((_FAILING % _SMALL).format(use=body), str(tmp_path / "ck"), str(TESTS))
    failed = done.stdout.split()[-1]
    assert failed in done.stderr and "No space left" in done.stderr, done.stderr
    if use == "with":
        assert done.returncode == 1, "the with block raised the save's error"
        assert "StorageError" in done.stderr
    else:
        # nothing raised it: reported at exit (an exit hook cannot change the exit status)
        assert done.returncode == 0, done.stderr
        assert f"checkpoint {failed} under" in done.stderr and "nothing observed its error" in done.stderr


def test_without_the_early_exit_hook_a_save_lost_at_exit_is_reported(tmp_path: Path) -> None:
    """Where ``threading._register_atexit`` (CPython-private) is missing, saves are finished
    from atexit only, after the thread pools stopped taking work: one still in flight then
    fails, and says so on stderr (it is never lost without a word)."""
    root = tmp_path / "ck"
    done = _run_script(f"""
        import sys, threading
        import torch, gpusnap
        del threading._register_atexit  # (gpusnap looks for it at its first Checkpointer)
        ck = gpusnap.Checkpointer(sys.argv[1], config={_SMALL})
        print(ck.save({{"w": torch.arange(100_000, dtype=torch.float32)}}).id)
    """, str(root))
    assert done.returncode == 0, done.stderr
    saved = done.stdout.split()[-1]
    committed = [m.id for m in Repository.open(root).list()] == [saved]
    reported = f"checkpoint {saved} under" in done.stderr and "nothing observed its error" in done.stderr
    assert committed or reported, done.stderr
