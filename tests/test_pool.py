"""The warm process pool (``gpusnap.pool``) on CPU: its processes start, take a checkpoint,
serve it with the source model's logits, are replaced, and die cleanly; a process that
dies, or a checkpoint that does not fit the model built, never leaves a model serving.

Each pool process imports torch (seconds on CPU): the tests use few of them, and wait on
the pool's own signals (``wait_ready``, ``take``, ``PoolProcess.wait``), never on time.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from pool_support import reference_logits, trained
from restore_support import tiny_config

import gpusnap
from gpusnap.cli.exits import EXIT_ERROR
from gpusnap.cli.main import main
from gpusnap.pool import Pool, PoolError, PoolProcess

IDS = [[1, 5, 9, 3, 7, 2]]
HANG_S = 240.0  # bounds a hang only


def _save(root: Path, model: torch.nn.Module, tag: str | None = None) -> str:
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        return ck.save({"model": model}, tag=tag, blocking=True).wait().id


def _logits(model: torch.nn.Module) -> torch.Tensor:
    return reference_logits(model, IDS)


def _served(value: dict[str, Any]) -> torch.Tensor:
    return torch.tensor(value["logits"], dtype=torch.float32)


def gone(pid: int) -> bool:
    """The process has been reaped (no /proc entry) or is a zombie nobody will run again."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except FileNotFoundError:
        return True


def _started(events: list[dict[str, Any]]) -> list[int]:
    return [e["pid"] for e in events if e["event"] == "pool-started"]


def test_processes_take_serve_are_replaced_and_stop(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    old, new = trained(0), trained(1)
    _save(root, old, tag="old")
    _save(root, trained(2, dim=48), tag="wide")  # another model: it does not fit the one built
    newest = _save(root, new)
    events: list[dict[str, Any]] = []
    died = threading.Event()

    def seen(event: dict[str, Any]) -> None:
        events.append(event)
        if event["event"] == "pool-died":
            died.set()

    marker = tmp_path / "ran"
    pool = Pool(root, "pool_support:serve", size=1, config=tiny_config(),
                env={"GPUSNAP_POOL_FAULT": "die-loading@2"}, on_event=seen)
    try:
        # process 0: the newest checkpoint, served with the source model's logits, in eval mode
        proc = pool.take(params={"ids": IDS}, timeout=HANG_S)
        assert isinstance(proc, PoolProcess) and proc.checkpoint == newest
        assert proc.stats["source"] == "files" and proc.stats["take_s"] > 0 and proc.stats["warm_up_s"] >= 0
        done = proc.wait(HANG_S)
        assert done.returncode == 0 and done.error is None and not done.value["training"]
        assert torch.equal(_served(done.value), _logits(new)) and done.value["checkpoint"] == newest
        assert not proc.alive and proc.poll() == done

        # process 1, its replacement, is killed while it waits: process 2 replaces it
        pool.wait_ready(HANG_S)
        (idle,) = pool.ready_pids
        assert idle != proc.pid
        os.kill(idle, signal.SIGKILL)
        assert died.wait(HANG_S)
        pool.wait_ready(HANG_S)
        assert pool.ready_pids != [idle]
        assert any(e["event"] == "pool-died" and e["pid"] == idle and e["replaced"] for e in events)

        # process 2 dies once its weights are written, before it says so: the take fails, nothing ran
        with pytest.raises(PoolError, match=r"ended \(killed by SIGKILL\) before every weight was in place"):
            pool.take("old", params={"marker": str(marker)}, timeout=HANG_S)
        assert not marker.exists()

        # process 3 is asked for a checkpoint of another model: refused before a byte moves
        with pytest.raises(gpusnap.RestoreMismatchError, match="wide|does not fit"):
            pool.take("wide", params={"marker": str(marker)}, timeout=HANG_S)
        assert not marker.exists()
        refused = [e["pid"] for e in events if e["event"] == "pool-taken"][-1]
        assert gone(refused)

        # process 4 serves the tagged checkpoint until stopped (once its entry says it runs:
        # take() returns when the weights are in place, before the entry is called)
        holding = tmp_path / "holding"
        os.mkfifo(holding, 0o600)
        reader = os.open(holding, os.O_RDONLY | os.O_NONBLOCK)
        try:
            held = pool.take("old", params={"hold": True, "holding": str(holding)}, timeout=HANG_S)
            assert held.checkpoint != newest
            assert select.select([reader], [], [], HANG_S)[0], "the entry never ran"
            assert int(os.read(reader, 64)) == held.pid
        finally:
            os.close(reader)
        stopped = held.stop()
        assert stopped.returncode == -signal.SIGTERM and stopped.error == "killed by SIGTERM"

        # process 5 serves and is still running when the pool closes
        last = pool.take("old", params={"ids": IDS, "hold": True}, timeout=HANG_S)
    finally:
        pool.close()
    assert last.poll() is not None and last.poll().returncode == -signal.SIGTERM
    assert all(gone(pid) for pid in _started(events)), "every process the pool started is reaped"
    assert len(_started(events)) == 7  # (the last, a replacement, was stopped while it started or waited)
    with pytest.raises(PoolError, match="closed"):
        pool.take()


def test_a_process_that_cannot_start_is_a_clear_error(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _save(root, trained(0))
    undecorated = Pool(root, "pool_support:undecorated", size=1)
    no_device = Pool(root, "pool_support:serve", size=1, device="cuda:99")
    try:
        with pytest.raises(PoolError, match="declares no model to build: decorate it with @gpusnap.pool.entry"):
            undecorated.take(timeout=HANG_S)
        with pytest.raises(PoolError, match="device is cuda:99, but this process sees"):
            no_device.wait_ready(HANG_S)
        with pytest.raises(PoolError, match="can be had"):
            no_device.take(timeout=HANG_S)  # (not restarted: the next would fail the same way)
    finally:
        undecorated.close()
        no_device.close()


def test_a_process_whose_loaded_message_cannot_be_read_is_stopped_and_replaced(tmp_path: Path) -> None:
    """As a process of another gpusnap version might: the take fails clearly, that process is
    reaped (it went on to serve as if heard), and its replacement serves."""
    root = tmp_path / "ck"
    model = trained(0)
    _save(root, model)
    events: list[dict[str, Any]] = []
    pool = Pool(root, "pool_support:serve", size=1, config=tiny_config(),
                env={"GPUSNAP_POOL_FAULT": "garble-loading@0"}, on_event=events.append)
    try:
        with pytest.raises(PoolError, match=r"could not load .* in a message this pool cannot read .*\['garbled'\]"):
            pool.take(params={"hold": True}, timeout=HANG_S)
        (garbled,) = [e["pid"] for e in events if e["event"] == "pool-taken"]
        assert gone(garbled)
        proc = pool.take(params={"ids": IDS}, timeout=HANG_S)
        assert proc.pid != garbled and torch.equal(_served(proc.wait(HANG_S).value), _logits(model))
    finally:
        pool.close()


def test_bad_arguments_are_refused_before_any_process_starts(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    def local(ready: Any) -> None:
        pass

    for entry, match in [("no_colon", "module:function"), ("a:b c", "module:function"), (local, "cannot be imported"),
                         (print, "declares no model"), (3, "function or a 'module:function'")]:
        with pytest.raises((ValueError, TypeError), match=match):
            Pool(tmp_path, entry)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive integer"):
        Pool(tmp_path, "m:f", size=0)
    with pytest.raises(ValueError, match="cuda, cuda:N or cpu"):
        Pool(tmp_path, "m:f", device="meta")
    with pytest.raises(TypeError, match="gpusnap.Config"):
        Pool(tmp_path, "m:f", config={"chunk_size": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="env maps names to strings"):
        Pool(tmp_path, "m:f", env={"X": 1})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="decorates the entry function"):
        gpusnap.pool.entry(build=torch.nn.Identity)(None)  # type: ignore[type-var]
    with pytest.raises(TypeError, match="must be callable"):
        gpusnap.pool.entry(build=None)  # type: ignore[arg-type]
    for args, match in [(["--pool", "1"], "go together"), (["--entry", "m:f"], "go together"),
                        (["--pool", "2", "--entry", "nocolon"], "module:function"),
                        (["--pool", "-1", "--entry", "m:f"], "positive integer")]:
        assert main(["serve", str(tmp_path / "ck"), "--device", "cpu", *args]) == EXIT_ERROR
        assert match in capsys.readouterr().err



# A pool's owner that hands out a process (its entry starts a helper of its own, which says
# its pid and its parent's, the serving process, through a FIFO), then waits to be killed.
OWNER = """
import sys
sys.path.insert(0, sys.argv[1])
from restore_support import tiny_config
from gpusnap.pool import Pool
pool = Pool(sys.argv[2], "pool_support:serve", size=1, device="cpu", config=tiny_config())
helper = ["sh", "-c", f'echo $$ $PPID > {sys.argv[3]}; exec sleep 100000']
pool.take(params={"spawn": helper, "hold": True}, timeout=240)
sys.stdin.readline()
"""


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="waits for the processes through pidfds (Linux)")
def test_a_taken_process_and_what_its_entry_started_end_with_their_pool(tmp_path: Path) -> None:
    """The owner is SIGKILLed: the serving process kills its whole group, as close() does
    (before: only itself, and the entry's helper lived on, an orphan)."""
    root, fifo = tmp_path / "ck", tmp_path / "pids"
    _save(root, trained(0))
    os.mkfifo(fifo, 0o600)
    said = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # (no hang: readable once the helper wrote)
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(Path(__file__).parent), str(root), str(fifo)],
                             stdin=subprocess.PIPE)
    pids: list[int] = []
    try:
        assert select.select([said], [], [], HANG_S)[0], "the entry never ran"
        helper, serving = (int(p) for p in os.read(said, 100).split())
        pids = [serving, helper]
        ends = [os.pidfd_open(pid) for pid in pids]  # (readable once the process has exited)
        owner.kill()
        owner.wait(HANG_S)
        try:
            for fd, pid in zip(ends, pids):
                assert select.select([fd], [], [], HANG_S)[0], f"process {pid} outlived its pool"
        finally:
            for fd in ends:
                os.close(fd)
    finally:
        os.close(said)
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        for pid in pids:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
