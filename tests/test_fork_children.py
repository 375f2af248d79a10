"""Issue 37, item 12: a forked child never waits for a thread of its parent.

``os.fork()`` copies the forking thread only: a lazy restore's gate or a save's tracker on
that thread would wait in the child for loader or copier threads that do not exist there.
A fork during a lazy restore waits for the load (the child reads restored bytes: a
DataLoader worker's data is right); a child forked during a save's window writes freely
(its own memory), and the parent's checkpoint is still the state at save().

The parent's side is held with the usual helpers (``restore_hold``, the ``gate`` fixture),
so the fork always happens while the restore loads, or while the window holds pending
spans. A child that hangs is killed after ``HANG_S`` and the test fails.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from capture_support import assert_bits, restored, tracked_config
from faults import HANG_S
from restore_hold import hold_loads
from restore_support import tiny_config
from torch.utils.data import DataLoader, Dataset

import gpusnap

# (Python 3.12+ warns at every fork of a process with threads: here that is the point)
pytestmark = pytest.mark.filterwarnings("ignore:.*use of fork\\(\\) may lead to deadlocks:DeprecationWarning")


def _wait_child(pid: int) -> int:
    """The child's exit code; a child still running after ``HANG_S`` is killed (a hang)."""
    deadline = time.monotonic() + HANG_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child still ran after {HANG_S:.0f} s: it waits for a thread of its parent")
        time.sleep(0.01)  # (a hang guard's poll: the child's own work bounds the test)


def _in_child(work: Callable[[], None]) -> tuple[int, str]:
    """Run ``work`` in a forked child: its exit code (0: it returned) and its traceback."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code, report = 0, ""
        try:
            os.close(read)
            work()
        except BaseException:  # noqa: BLE001 (reported to the parent)
            code, report = 1, traceback.format_exc()[-3000:]
        finally:
            os.write(write, report.encode())
            os._exit(code)
    os.close(write)
    try:
        code = _wait_child(pid)
        report = os.read(read, 1 << 16).decode(errors="replace")
    finally:
        os.close(read)
    return code, report


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(37)
    return {"w": torch.randn(64, 32), "ids": torch.arange(64 * 5, dtype=torch.int64).reshape(64, 5) * 3 + 1}


def _expect_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for key, value in want.items():
        if not torch.equal(got[key], value):  # an op: through the gate, if the child has one
            raise AssertionError(f"{key}: the child read other bytes than the checkpoint's")
        if got[key].tolist() != value.tolist():  # a door
            raise AssertionError(f"{key}: tolist() in the child read other bytes than the checkpoint's")


def _saved(tmp_path: Path) -> tuple[gpusnap.Checkpointer, dict[str, torch.Tensor]]:
    source = _state()
    ck = gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config())
    ck.save(source, blocking=True)
    return ck, source


def test_a_fork_during_a_lazy_restore_waits_for_it_and_the_child_reads_restored_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck, source = _saved(tmp_path)
    with ck:
        target = {k: torch.zeros_like(v) for k, v in source.items()}
        hold = hold_loads(monkeypatch)  # nothing loads until something waits for the load
        handle = ck.restore(target, lazy=True)
        assert not handle.done() and not hold.waits, "the restore must still be loading at the fork"
        code, report = _in_child(lambda: _expect_equal(target, source))
        assert code == 0, report
        assert hold.waits == ["join"], "the fork waited for the load"
        handle.wait()
        _expect_equal(target, source)


def test_a_fork_from_another_thread_during_a_lazy_restore_waits_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child's one thread is a copy of a thread the gate never covered: only the wait
    before the fork makes what it reads the restored bytes."""
    ck, source = _saved(tmp_path)
    with ck:
        target = {k: torch.zeros_like(v) for k, v in source.items()}
        hold = hold_loads(monkeypatch)
        handle = ck.restore(target, lazy=True)
        assert not handle.done() and not hold.waits, "the restore must still be loading at the fork"
        outcome: list[Any] = []

        def fork_here() -> None:
            try:
                outcome.append(_in_child(lambda: _expect_equal(target, source)))
            except BaseException as exc:  # noqa: BLE001 (pytest.fail on a hang: raised below)
                outcome.append(exc)

        forker = threading.Thread(target=fork_here, name="program-forker")
        forker.start()
        forker.join()
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        code, report = outcome[0]
        assert code == 0, report
        assert hold.waits == ["join"], "the fork waited for the load"
        handle.wait()


class _Rows(Dataset[torch.Tensor]):
    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def __len__(self) -> int:
        return self.state["w"].shape[0]

    def __getitem__(self, i: int) -> Any:
        return self.state["w"][i], self.state["ids"][i]


def test_dataloader_fork_workers_read_a_lazily_restored_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The case users meet: DataLoader(num_workers>0) forks its workers right after a lazy
    restore of the data they read."""
    ck, source = _saved(tmp_path)
    with ck:
        target = {k: torch.zeros_like(v) for k, v in source.items()}
        hold = hold_loads(monkeypatch)
        handle = ck.restore(target, lazy=True)
        loader = DataLoader(_Rows(target), batch_size=8, num_workers=2, multiprocessing_context="fork",
                            timeout=HANG_S)  # (a worker that hangs fails the test after HANG_S)
        assert not handle.done() and not hold.waits, "the restore must still be loading when the workers fork"
        batches = list(loader)
        assert hold.waits == ["join"], "the first worker's fork waited for the load"
        handle.wait()
    assert torch.equal(torch.cat([w for w, _ in batches]), source["w"])
    assert torch.equal(torch.cat([ids for _, ids in batches]), source["ids"])


def test_a_child_forked_during_a_tracked_save_writes_and_the_parent_commits_the_state_at_save(
    tmp_path: Path, gate: Any
) -> None:
    """No copy-on-write budget: in the parent a write to a pending span waits for its copy.
    In the child no copier runs: its writes must not wait (its memory is its own)."""
    state = {"a": torch.randn(4096), "b": torch.randn(1000), "c": torch.arange(300, dtype=torch.int32)}
    at_save = {k: v.clone() for k, v in state.items()}

    def child() -> None:
        state["b"].fill_(-1.0)
        state["a"].mul_(2.0)
        state["c"].add_(5)
        if not (torch.equal(state["b"], torch.full_like(at_save["b"], -1.0))
                and torch.equal(state["a"], at_save["a"] * 2.0) and torch.equal(state["c"], at_save["c"] + 5)):
            raise AssertionError("the child's writes did not land")

    with gpusnap.Checkpointer(tmp_path / "ck", config=tracked_config(cow_budget_bytes=1)) as ck:
        pending = ck.save(state)  # the gate holds every chunk store: the copier stalls, spans pending
        code, report = _in_child(child)
        assert code == 0, report
        assert not pending.done()
        gate.release()
        info = pending.wait(timeout=HANG_S)
        assert_bits(restored(ck, at_save, info.id), at_save)
    assert_bits(state, at_save)  # the child's writes stayed in the child


def test_a_child_waiting_for_its_parents_pending_save_gets_an_error_not_a_hang(tmp_path: Path, gate: Any) -> None:
    state = {"a": torch.randn(4096)}
    with gpusnap.Checkpointer(tmp_path / "ck", config=tracked_config()) as ck:
        pending = ck.save(state)  # held by the gate: pending at the fork

        def child() -> None:
            for call in (pending.wait, ck.wait, lambda: ck.save(state)):
                with pytest.raises(gpusnap.CheckpointError, match="forked from"):
                    call()

        code, report = _in_child(child)
        assert code == 0, report
        gate.release()
        pending.wait(timeout=HANG_S)  # the parent's save is unaffected
