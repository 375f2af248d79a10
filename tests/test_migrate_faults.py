"""Live migration under faults: either side killed at adversarial moments, a transport that
refuses writes, a round that reads back corrupt.

The rule each test checks: the other side goes on or fails cleanly. A target whose source
died fails with a MigrationError saying what app_state holds (untouched, or one complete,
consistent round), never a mixture; a source whose target died goes on, and a new target
receives everything. Kills happen where a hook in the child's storage backend has parked
it (a write of the round chosen, a read of a round), so each run meets the same moment.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from faults import FaultyBackend
from restore_support import HeldBackend
from test_migrate import CFG, HANG_S, Applied, _join, _receive_in_thread

from gpusnap.config import Config
from gpusnap.migrate import MigrationError, Source, Target, transport
from gpusnap.storage.backend import LocalBackend, open_backend
from gpusnap.storage.repository import Repository

TESTS = str(Path(__file__).resolve().parent)
N = 20_000  # floats: five 4 KiB chunks' worth... and more


def _state(step: int) -> dict[str, Any]:
    """The source's state at ``step``: every chunk distinct, every step different."""
    return {"w": torch.arange(N, dtype=torch.float32) + 1e6 * step, "step": step}


def _blank() -> dict[str, Any]:
    return {"w": torch.full((N,), -1.0), "step": -1}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["step"] == b["step"] and torch.equal(a["w"], b["w"])


@contextmanager
def _child(script: str, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", script, TESTS, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=HANG_S)


def _line(proc: subprocess.Popen[bytes]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    if not line:
        proc.kill()
        raise AssertionError(f"the child ended: {proc.communicate(timeout=HANG_S)[1].decode()[-3000:]}")
    return line


def _tell(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdin is not None
    proc.stdin.write(b"go\n")
    proc.stdin.flush()


# A source whose transport's writes stop (for good) at the round named by argv[2]: "1", "2",
# "handoff" (after rounds 1 and 2: a fast handoff, stopped at its header's commit) or
# "handoff-general" (Source(fast_handoff=False): at the last round's writes). It says
# "blocked" there; the parent kills it. (A source gone before any round:
# test_a_source_that_calls_the_migration_off_fails_its_target.)
SOURCE = textwrap.dedent(
    """
    import sys, threading, torch
    sys.path.insert(0, sys.argv[1])
    from faults import FaultyBackend
    from gpusnap.config import Config
    from gpusnap.migrate import Source, source as source_module
    from gpusnap.storage.backend import open_backend
    from gpusnap.storage.repository import Repository
    kill_at, now = sys.argv[2], {"round": None}

    def before_write(path):
        if now["round"] == kill_at:
            print("blocked", flush=True)
            threading.Event().wait()          # parked until the parent kills this process

    def before_rename(path):
        if path == "migrate/handoff.json":
            before_write(path)

    real_open = Repository.open.__func__
    def faulty_open(cls, root, **kw):
        backend = FaultyBackend(open_backend(root))
        backend.before_write = before_write
        return real_open(cls, root, **{**kw, "backend": backend})
    Repository.open = classmethod(faulty_open)

    def faulty_backend(root):   # the transport's own files (the fast handoff's header)
        backend = FaultyBackend(open_backend(root))
        backend.before_rename = before_rename
        return backend
    source_module.open_backend = faulty_backend

    N = 20_000
    def state_at(app, step):
        app["w"].copy_(torch.arange(N, dtype=torch.float32) + 1e6 * step)
        app["step"] = step

    app = {"w": torch.zeros(N), "step": 0}
    state_at(app, 1)
    src = Source(app, config=Config(chunk_size=4096, io_threads=1), fast_handoff=kill_at != "handoff-general")
    print(src.address, flush=True)
    input()
    now["round"] = "1"
    src.precopy(wait=True)
    print("round 1", flush=True)
    input()
    state_at(app, 2)
    now["round"] = "2"
    src.precopy(wait=True)
    print("round 2", flush=True)
    input()
    state_at(app, 3)
    now["round"] = kill_at if kill_at.startswith("handoff") else "handoff"
    src.handoff()
    print("handed off", flush=True)
    """
)


@pytest.mark.parametrize("kill_at", ["2", "handoff", "handoff-general"])
def test_a_source_killed_before_its_handoff_fails_the_target_cleanly(kill_at: str) -> None:
    copy = _blank()
    applied = Applied()
    with _child(SOURCE, kill_at) as proc:
        address = _line(proc)
        dst = Target(address, on_round=applied, poll_s=0.05)  # (how soon it looks at a silent source)
        thread, out = _receive_in_thread(dst, copy)
        _tell(proc)
        rounds = {"1": 0, "2": 1, "handoff": 2, "handoff-general": 2}[kill_at]
        for seq in range(1, rounds + 1):
            assert _line(proc) == f"round {seq}"
            applied.wait_for(seq)  # (a consistent round in place before the next one starts)
            _tell(proc)
        assert _line(proc) == "blocked"
        proc.kill()
        proc.wait()
        thread.join(HANG_S)
    assert not thread.is_alive()
    error = out.get("error")
    assert isinstance(error, MigrationError), out
    assert "ended before handing off" in str(error)
    if rounds == 0:
        assert "app_state is untouched" in str(error)
        assert _same(copy, _blank())
    else:
        assert f"holds round {rounds} " in str(error) and "consistent" in str(error)
        assert _same(copy, _state(rounds))  # the whole round, nothing of the one being written
    assert not os.path.exists(address), "a transport nothing can complete stayed in host memory"
    dst.close()


# A target that receives until it is reading round 2, says "reading" there and is killed.
TARGET = textwrap.dedent(
    """
    import sys, threading, torch
    sys.path.insert(0, sys.argv[1])
    from faults import FaultyBackend
    from gpusnap.migrate import Target
    from gpusnap.storage.backend import open_backend
    from gpusnap.storage.repository import Repository
    applied = {"seq": 0}

    class Parked(FaultyBackend):
        def readinto_range(self, path, offset, out):
            if applied["seq"] >= 1:
                print("reading", flush=True)
                threading.Event().wait()      # parked until the parent kills this process
            return super().readinto_range(path, offset, out)

    real_open = Repository.open.__func__
    Repository.open = classmethod(lambda cls, root, **kw: real_open(cls, root, **{**kw, "backend": Parked(
        open_backend(root))}))

    def on_round(r):
        applied["seq"] = r.seq
        print(f"applied {r.seq}", flush=True)

    app = {"w": torch.zeros(20_000), "step": -1}
    Target(sys.argv[2], on_round=on_round).receive(app)
    """
)


def test_a_target_killed_mid_round_leaves_the_source_running_and_a_new_target_receives() -> None:
    app = _state(1)
    with Source(app, config=CFG) as src:
        with _child(TARGET, src.address) as proc:
            src.precopy(wait=True)
            assert _line(proc) == "applied 1"
            app.update(_state(2))
            src.precopy(wait=True)  # the target claims it and starts reading: parked there
            assert _line(proc) == "reading"
            proc.kill()
            proc.wait()
        app.update(_state(3))
        src.precopy(wait=True)  # the source goes on; the dead target's claim keeps nothing
        assert [m.tag for m in Repository.open(src.address).list()] == ["migrate-000003"]
        app.update(_state(4))
        copy = _blank()
        with Target(src.address) as dst:  # a new target takes over
            thread, out = _receive_in_thread(dst, copy)
            src.handoff()
            info = _join(thread, out)
    assert _same(copy, _state(4)) and info.rounds[-1].final


@pytest.fixture
def faulty(monkeypatch: pytest.MonkeyPatch) -> FaultyBackend | Any:
    """Every repository opened on a root meanwhile goes through one FaultyBackend per root
    (the source's Checkpointer and the target alike); ``faulty.backends[root]``."""
    backends: dict[str, FaultyBackend] = {}
    real_open = Repository.open.__func__  # type: ignore[attr-defined]

    def opening(cls: type[Repository], root: Any, **kw: Any) -> Repository:
        key = str(root)
        if key not in backends:
            backends[key] = FaultyBackend(open_backend(key))
        return real_open(cls, root, **{**kw, "backend": backends[key]})

    monkeypatch.setattr(Repository, "open", classmethod(opening))
    return backends


def test_a_round_the_transport_refuses_is_raised_once_and_the_source_goes_on(faulty: dict[str, FaultyBackend]) -> None:
    app = _state(1)
    with Source(app, config=CFG) as src:
        backend = faulty[src.address]
        backend.write_budget = backend.bytes_written  # a full disk from now on
        pending = src.precopy()
        assert pending is not None and pending.exception(HANG_S) is not None
        with pytest.raises(MigrationError, match="round 1 of the migration .* failed") as caught:
            src.precopy()
        assert "ENOSPC" in str(caught.value.__cause__) or "No space" in str(caught.value.__cause__)
        backend.write_budget = None  # room again
        app.update(_state(2))
        assert src.precopy(wait=True) is not None
        copy = _blank()
        with Target(src.address) as dst:
            thread, out = _receive_in_thread(dst, copy)
            app.update(_state(3))
            src.handoff()
            _join(thread, out)
    assert _same(copy, _state(3))


def test_a_failed_handoff_hands_nothing_off_and_can_be_made_again(faulty: dict[str, FaultyBackend]) -> None:
    app = _state(1)
    copy = _blank()
    applied = Applied()
    with Source(app, config=CFG, fast_handoff=False) as src, Target(src.address, on_round=applied) as dst:
        thread, out = _receive_in_thread(dst, copy)
        src.precopy(wait=True)
        applied.wait_for(1)
        backend = faulty[src.address]
        backend.write_budget = backend.bytes_written
        app.update(_state(2))
        with pytest.raises(MigrationError, match="nothing was handed off"):
            src.handoff()
        assert not src.handed_off and thread.is_alive()  # the target waits on
        backend.write_budget = None
        app.update(_state(3))  # the program went on
        src.handoff()
        _join(thread, out)
    assert _same(copy, _state(3))


def test_a_corrupt_round_fails_the_target_with_the_round_before_in_place(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    app = _state(1)
    with Source(app, config=CFG) as src:
        root = Path(src.address)
        held = HeldBackend(LocalBackend(root))
        real_open = Repository.open.__func__  # type: ignore[attr-defined]
        with monkeypatch.context() as patch:  # (the target's reads only: the source opened its own already)
            patch.setattr(Repository, "open", classmethod(lambda cls, where, **kw: real_open(
                cls, where, **{**kw, "backend": held})))
            dst = Target(src.address, verify="upfront", on_round=(applied := Applied()))
        src.precopy(wait=True)
        copy = _blank()
        thread, out = _receive_in_thread(dst, copy)
        applied.wait_for(1)
        held.hold()  # round 2's chunks are read only once they are corrupt
        packs_before = set(root.glob("packs/*/*.pack"))
        app.update(_state(2))
        src.precopy(wait=True)
        (new,) = set(root.glob("packs/*/*.pack")) - packs_before
        with open(new, "r+b") as f:  # a flipped byte in the first chunk
            f.seek(8)
            byte = f.read(1)
            f.seek(8)
            f.write(bytes([byte[0] ^ 0xFF]))
        held.release()
        thread.join(HANG_S)
        dst.close()
    error = out.get("error")
    assert isinstance(error, MigrationError), out
    assert "holds round 1 " in str(error) and "consistent" in str(error), str(error)
    assert _same(copy, _state(1))


def test_a_silent_source_times_the_target_out_with_its_state_untouched() -> None:
    app = _state(1)
    with Source(app, config=CFG) as src, Target(src.address, timeout=0.05, poll_s=0.01) as dst:
        copy = _blank()
        with pytest.raises(MigrationError, match="no new round from the source for 0.05 s.*untouched"):
            dst.receive(copy)
    assert _same(copy, _blank())


@pytest.mark.parametrize("rounds", [0, 1])
def test_a_source_that_calls_the_migration_off_fails_its_target(rounds: int) -> None:
    app = _state(1)
    src = Source(app, config=CFG)
    copy = _blank()
    applied = Applied()
    dst = Target(src.address, on_round=applied, poll_s=0.05)
    thread, out = _receive_in_thread(dst, copy)
    if rounds:
        src.precopy(wait=True)
        applied.wait_for(1)
    src.close()  # before any handoff: called off, the transport removed
    thread.join(HANG_S)
    assert isinstance(out.get("error"), MigrationError), out
    if rounds:
        assert "holds round 1 " in str(out["error"])
        assert _same(copy, _state(1))
    else:
        assert "app_state is untouched" in str(out["error"])
        assert _same(copy, _blank())
    assert not os.path.exists(src.address)
    dst.close()


# A source that commits round 1, forks a helper (no exec: it inherits the source's flock)
# and is killed; the helper lives on until the parent kills it.
FORKING_SOURCE = textwrap.dedent(
    """
    import os, signal, sys, torch
    sys.path.insert(0, sys.argv[1])
    from gpusnap.config import Config
    from gpusnap.migrate import Source
    app = {"w": torch.arange(20_000, dtype=torch.float32) + 1e6, "step": 1}
    src = Source(app, config=Config(chunk_size=4096, io_threads=1))
    src.precopy(wait=True)
    helper = os.fork()
    if helper == 0:
        os.close(1)
        signal.pause()
        os._exit(0)
    print(src.address, helper, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_source_killed_while_a_process_it_forked_lives_on_fails_the_target() -> None:
    """Its forked helper keeps the source's flock: the target also asks whether the source's
    own process lives (before: it waited for the helper, forever without a timeout)."""
    copy = _blank()
    with _child(FORKING_SOURCE) as proc:
        address, helper = _line(proc).split()
        proc.wait()
        try:
            dst = Target(address, poll_s=0.05)
            thread, out = _receive_in_thread(dst, copy)
            thread.join(HANG_S)
            assert not thread.is_alive(), "the target waits for a source that is gone"
        finally:
            os.kill(int(helper), 9)
    error = out.get("error")
    assert isinstance(error, MigrationError), out
    assert "ended before handing off" in str(error) and "holds round 1 " in str(error)
    assert _same(copy, _state(1))
    assert not os.path.exists(address), "a transport nothing can complete stayed in host memory"
    dst.close()


# A target that forks a helper (no exec: it inherits the target's descriptors) and is killed
# once the helper runs; the helper lives on until the parent kills it.
FORKING_TARGET = textwrap.dedent(
    """
    import os, signal, sys
    from gpusnap.migrate import Target
    dst = Target(sys.argv[2])
    ran, told = os.pipe()
    helper = os.fork()
    if helper == 0:
        os.write(told, b"1")                  # (its fork hooks have run)
        os.close(1)
        signal.pause()
        os._exit(0)
    os.read(ran, 1)
    print(helper, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_target_killed_while_a_process_it_forked_lives_on_leaves_the_transport_to_a_new_target() -> None:
    """A forked child closes its copy of the target's lock: a flock lasts while any copy of its
    descriptor is open, and the helper must not keep the next target out."""
    app = _state(1)
    with Source(app, config=CFG) as src:
        with _child(FORKING_TARGET, src.address) as proc:
            helper = int(_line(proc))
            try:
                proc.wait()
                copy = _blank()
                with Target(src.address) as dst:
                    thread, out = _receive_in_thread(dst, copy)
                    src.handoff()
                    _join(thread, out)
            finally:
                os.kill(helper, 9)
    assert _same(copy, _state(1))


@pytest.mark.parametrize("reading", [["a list"], {"a": "dict"}, 7])
def test_a_claim_file_this_code_did_not_write_never_stops_a_round(reading: Any) -> None:
    app = _state(1)
    with Source(app, config=CFG) as src:
        assert src.address is not None
        lock = transport.Flock(os.path.join(src.address, transport.TARGET_LOCK))  # (a live target's)
        try:
            transport.write_json(open_backend(src.address), transport.TARGET_FILE, {"reading": reading, "bell": None})
            src.precopy(wait=True)
            app.update(_state(2))
            src.precopy(wait=True)
            app.update(_state(3))
            src.handoff()
        finally:
            lock.release()
        assert [r.seq for r in src.rounds] == [1, 2, 3]


def test_a_process_of_another_pid_namespace_is_never_judged_dead() -> None:
    """A pid means nothing in another pid namespace (a container sharing the host name): the
    flock alone decides there, else the source of a target in a sibling container would be
    taken for dead."""
    ended = subprocess.Popen([sys.executable, "-c", ""])
    ended.wait()
    dead = {**transport.whoami(), "pid": ended.pid, "pid_start": None}
    assert transport.process_alive(dead) is False
    assert transport.process_alive({**dead, "pid_ns": "pid:[1]"}) is None
    assert transport.process_alive(transport.whoami()) is True


# A source in host memory under argv[2] that commits round 1 (and its handoff, when argv[3]
# says so), says its address and is killed.
KILLED_SOURCE = textwrap.dedent(
    """
    import os, signal, sys, torch
    from gpusnap.config import Config
    from gpusnap.migrate import Source
    app = {"w": torch.arange(20_000, dtype=torch.float32) + 1e6, "step": 1}
    src = Source(app, config=Config(chunk_size=4096, io_threads=1, memory_tier_dir=sys.argv[2]))
    src.precopy(wait=True)
    if sys.argv[3] == "handoff":
        src.handoff()
    print(src.address, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_new_source_sweeps_the_transports_of_dead_sources_that_nothing_can_complete(tmp_path: Path) -> None:
    """A source killed before its handoff leaves its transport in host memory; the next
    Source of this user removes it. A handed-off one waits for its target (however late),
    and a live source's stays."""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    cfg = Config(chunk_size=4096, io_threads=1, memory_tier_dir=str(shm))
    left = {}
    for when in ("handoff", "before"):  # (the second one's start keeps the first: handed off)
        with _child(KILLED_SOURCE, str(shm), when) as proc:
            left[when] = _line(proc)
            proc.wait()
    assert all(os.path.isdir(root) for root in left.values())
    with Source(_state(5), config=cfg) as live:
        assert not os.path.exists(left["before"])
        assert os.path.isdir(left["handoff"])
        with Source(_state(6), config=cfg):
            assert os.path.isdir(live.address) and os.path.isdir(left["handoff"])
        copy = _blank()
        with Target(left["handoff"]) as dst:
            dst.receive(copy)
    assert _same(copy, _state(1))
    assert not os.path.exists(left["handoff"])
