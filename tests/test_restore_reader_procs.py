"""Restore reader processes (restore/pipeline/sources/reader_procs.py, reader_worker.py): every
byte arrives, and every failure of a process ends as the thread path would end, never as a
hang or a wrong byte."""

from __future__ import annotations

import marshal
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from faults import HANG_S
from restore_support import blank_like as _blank
from restore_support import corrupt_chunk, loader_batches, tiny_config
from restore_support import mixed_state as _state
from restore_support import states_equal as _equal

import gpusnap
from gpusnap import IntegrityError, StorageError
from gpusnap.restore import restorer as restorer_mod
from gpusnap.restore.pipeline.sources import reader_procs as read_procs
from gpusnap.restore.pipeline.staging import SlotPool, can_share

pytestmark = pytest.mark.skipif(not can_share(), reason="reader processes need memfd (Linux)")

CS = 512
PIECE = 8 * CS  # _config's restore_piece_bytes


class _Calls:
    """Wraps ReaderProcs.read: what each request returned or raised."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.results: list[Any] = []
        real = read_procs.ReaderProcs.read

        def read(procs: read_procs.ReaderProcs, k: int, runs: list[tuple[str, int, int, int]]) -> list[int]:
            try:
                got = real(procs, k, runs)
            except BaseException as exc:
                self.results.append(exc)
                raise
            self.results.append([(g, r[2]) for g, r in zip(got, runs)])
            return got

        monkeypatch.setattr(read_procs.ReaderProcs, "read", read)

    def short_reads(self) -> int:
        return sum(1 for r in self.results if isinstance(r, list) and any(g < n for g, n in r))

    def errors(self) -> list[BaseException]:
        return [r for r in self.results if isinstance(r, BaseException)]


def _config(**kw: Any) -> gpusnap.Config:
    kw.setdefault("restore_reader_processes", "on")
    kw.setdefault("restore_direct_copies", "off")  # (direct copies would take the device-checked batches)
    return tiny_config(io_threads=3, staging_bytes=64 * CS, restore_piece_bytes=PIECE, **kw)


def _save(root: Path, state: dict[str, Any]) -> str:
    with gpusnap.Checkpointer(root, config=_config()) as ck:
        return ck.save(state, blocking=True).wait().id


@pytest.mark.parametrize("verify", ["stream", "off"])
@pytest.mark.parametrize("on_device", ["on", "off"])
@pytest.mark.parametrize("lazy", [False, True])
def test_reader_processes_restore_every_byte(tmp_path: Path, verify: str, on_device: str, lazy: bool,
                                             device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    source = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in _state().items()}
    _save(tmp_path, source)
    target = _blank(source)
    streamed = loader_batches(monkeypatch, lambda ls: ls.streamed)  # (spans read whole stay with the threads)
    with gpusnap.Checkpointer(tmp_path, config=_config(restore_verify_on_device=on_device)) as ck:
        handle = ck.restore(target, verify=verify, lazy=lazy)
        handle.wait()
        stats = handle.stats
        procs = ck._restorer._procs
        assert procs is not None and procs.alive()
        pids = [p.pid for p in procs._procs]
    assert _equal(target, source)
    assert stats["reader_procs"] >= 1 and stats["proc_fallbacks"] == 0
    assert stats["proc_batches"] == len(streamed) > 0, "the processes read every streamed batch"
    assert stats["bytes_read"] == sum(v.numel() * 4 for v in source.values() if isinstance(v, torch.Tensor))
    for pid in pids:  # close() ended them
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_auto_reads_in_threads_without_cuda_targets(tmp_path: Path) -> None:
    source = _state()
    _save(tmp_path, source)
    target = _blank(source)
    with gpusnap.Checkpointer(tmp_path, config=_config(restore_reader_processes="auto")) as ck:
        stats = ck.restore(target, verify="stream").stats
        assert ck._restorer._procs is None
    assert stats["reader_procs"] == 0 and _equal(target, source)


def test_processes_are_kept_across_restores(tmp_path: Path) -> None:
    source = _state()
    _save(tmp_path, source)
    with gpusnap.Checkpointer(tmp_path, config=_config()) as ck:
        ck.restore(_blank(source), verify="stream")
        first = ck._restorer._procs
        target = _blank(source)
        ck.restore(target, verify="stream")
        assert ck._restorer._procs is first
    assert _equal(target, source)


def test_a_reader_process_killed_mid_restore_costs_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first request kills its process: that thread reads for itself from then on."""
    source = _state()
    _save(tmp_path, source)
    real = read_procs.ReaderProcs.read
    killed: list[int] = []

    def kill_first(self: read_procs.ReaderProcs, k: int, runs: list[tuple[str, int, int, int]]) -> list[int]:
        if not killed:
            proc = self._procs[k]
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed.append(proc.pid)
        return real(self, k, runs)

    monkeypatch.setattr(read_procs.ReaderProcs, "read", kill_first)
    target = _blank(source)
    with gpusnap.Checkpointer(tmp_path, config=_config()) as ck:
        stats = ck.restore(target, verify="stream").stats
        # the next restore starts new processes (one was dead)
        target2 = _blank(source)
        ck.restore(target2, verify="stream")
        assert ck._restorer._procs.alive()
    assert killed and stats["proc_fallbacks"] >= 1
    assert _equal(target, source) and _equal(target2, source)


@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_corrupt_chunk_is_caught_and_named_as_without_processes(tmp_path: Path, mode: str) -> None:
    source = _state()
    _save(tmp_path, source)
    corrupt_chunk(tmp_path, source["big3"].numpy().tobytes()[:64], 9)
    target = _blank(source)
    with gpusnap.Checkpointer(tmp_path, config=_config(restore_reader_processes=mode)) as ck:
        with pytest.raises(IntegrityError, match=r"big3.*does not match its digest"):
            ck.restore(target, verify="stream")


@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_truncated_pack_is_reported_as_without_processes(tmp_path: Path, mode: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Truncated after its index was read (a full disk under a copy, say): the process gets a
    short read, the thread reads again and names the chunk."""
    source = _state()
    _save(tmp_path, source)
    calls = _Calls(monkeypatch)
    with gpusnap.Checkpointer(tmp_path, config=_config(restore_reader_processes=mode)) as ck:
        ck.restore(_blank(source), verify="off")  # the pack indexes are read now
        packs = sorted((tmp_path / "packs").rglob("*.pack"), key=lambda p: p.stat().st_size)
        with open(packs[-1], "r+b") as f:
            f.truncate(packs[-1].stat().st_size // 2)
        with pytest.raises(IntegrityError, match=r"truncated"):
            ck.restore(_blank(source), verify="off")
    assert (calls.short_reads() >= 1) == (mode == "on"), "the process saw the short read; the thread explained it"


def test_an_unreadable_pack_fails_the_restore_with_a_storage_error(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that fails (here EISDIR: the packs were opened and indexed, then each one was
    replaced by a directory) reaches the caller as the thread path's StorageError."""
    source = _state()
    _save(tmp_path, source)
    calls = _Calls(monkeypatch)
    with gpusnap.Checkpointer(tmp_path, config=_config()) as ck:
        ck.restore(_blank(source), verify="off")  # the pack indexes are read now
        for p in list((tmp_path / "packs").rglob("*.pack")):
            p.unlink()
            p.mkdir()
        with pytest.raises(StorageError, match="reading chunk"):
            ck.restore(_blank(source), verify="off")
    assert any(isinstance(e, IsADirectoryError) for e in calls.errors()), "the process met the error first"


def test_worker_reads_runs_and_reports_errors(tmp_path: Path) -> None:
    """The worker alone: runs land at their ring offsets; a missing file is an error reply."""
    data = tmp_path / "data"
    data.write_bytes(bytes(range(256)) * 64)
    pool = SlotPool(2, 4096, pinned=False, shared=True)
    procs = read_procs.ReaderProcs(1, pool)
    try:
        got = procs.read(0, [(str(data), 10, 100, 0), (str(data), 16384 - 5, 50, 5000)])
        assert got == [100, 5]  # the second run ends at end of file
        mem = pool.shared.tensor
        assert bytes(mem[:100].numpy()) == (bytes(range(256)) * 64)[10:110]
        assert bytes(mem[5000:5005].numpy()) == (bytes(range(256)) * 64)[-5:]
        with pytest.raises(FileNotFoundError) as info:
            procs.read(0, [(str(tmp_path / "gone"), 0, 10, 0)])
        assert info.value.filename == str(tmp_path / "gone")
        assert procs.read(0, [(str(data), 0, 1, 0)]) == [1]  # still serving after an error
    finally:
        procs.close()
    with pytest.raises(read_procs.ReaderDied):
        procs.read(0, [(str(data), 0, 1, 0)])


def test_worker_exits_at_end_of_input(tmp_path: Path) -> None:
    fd = os.memfd_create("t")
    os.ftruncate(fd, 4096)
    body = marshal.dumps([])
    w = subprocess.run([sys.executable, "-I", "-S", read_procs.WORKER, str(fd), "4096"],
                       input=read_procs.LEN.pack(len(body)) + body, capture_output=True, pass_fds=(fd,), timeout=60)
    os.close(fd)
    assert w.returncode == 0, w.stderr
    assert w.stdout.count(b"ready") == 1 and marshal.dumps(("ok", [])) in w.stdout


def test_config_rejects_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="restore_reader_processes"):
        gpusnap.Config(restore_reader_processes="sometimes")


def test_module_override_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(restorer_mod, "READER_PROCESSES", "off")
    source = _state()
    _save(tmp_path, source)
    with gpusnap.Checkpointer(tmp_path, config=_config()) as ck:
        assert ck.restore(_blank(source), verify="off").stats["reader_procs"] == 0


def test_a_wedged_reader_process_is_killed_and_its_thread_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that stops answering (SIGSTOP) is killed after REPLY_TIMEOUT_S."""
    source = _state()
    _save(tmp_path, source)
    monkeypatch.setattr(read_procs, "REPLY_TIMEOUT_S", 0.5)
    real = read_procs.ReaderProcs.read
    stopped: list[int] = []

    def stop_first(self: read_procs.ReaderProcs, k: int, runs: list[tuple[str, int, int, int]]) -> list[int]:
        if not stopped and self.hello[k] is not None:  # (ready: its next reply is the one it never sends)
            self._procs[k].send_signal(signal.SIGSTOP)
            stopped.append(self._procs[k].pid)
        return real(self, k, runs)

    monkeypatch.setattr(read_procs.ReaderProcs, "read", stop_first)
    target = _blank(source)
    with gpusnap.Checkpointer(tmp_path, config=_config()) as ck:
        stats = ck.restore(target, verify="stream").stats
    assert stopped and stats["proc_fallbacks"] >= 1 and _equal(target, source)
    with pytest.raises(ChildProcessError):  # killed and reaped
        os.waitpid(stopped[0], os.WNOHANG)


def _fake_worker(tmp_path: Path, body: str) -> str:
    path = tmp_path / "fake_worker.py"
    path.write_text("import marshal, struct, sys, time\n"
                    "def send(o):\n"
                    "    b = marshal.dumps(o); sys.stdout.buffer.write(struct.pack('<Q', len(b)) + b); sys.stdout.buffer.flush()\n"
                    + body)
    return str(path)


def test_a_worker_that_never_starts_turns_processes_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """E.g. sys.executable is not a Python (an embedded interpreter): the restore still
    completes, in threads, within START_TIMEOUT_S, and later ones do not try again."""
    source = _state()
    _save(tmp_path, source)
    monkeypatch.setattr(read_procs, "WORKER", _fake_worker(tmp_path, "time.sleep(60)\n"))
    monkeypatch.setattr(read_procs, "START_TIMEOUT_S", 0.5)
    target = _blank(source)
    with gpusnap.Checkpointer(tmp_path, config=_config()) as ck:
        stats = ck.restore(target, verify="stream").stats
        with pytest.warns(RuntimeWarning, match="did not start"):
            again = ck.restore(_blank(source), verify="stream").stats
        assert ck._restorer._procs is None
    assert stats["proc_fallbacks"] >= 1 and stats["proc_batches"] == 0 and _equal(target, source)
    assert again["reader_procs"] == 0


def test_a_nonsense_reply_kills_the_worker_and_the_thread_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _state()
    _save(tmp_path, source)
    body = ("send('ready')\nwhile len(h := sys.stdin.buffer.read(8)) == 8:\n"
            "    sys.stdin.buffer.read(struct.unpack('<Q', h)[0])\n    send(42)  # (not the protocol)\n")
    monkeypatch.setattr(read_procs, "REPLY_TIMEOUT_S", 5.0)
    monkeypatch.setattr(read_procs, "WORKER", _fake_worker(tmp_path, body))
    calls = _Calls(monkeypatch)
    target = _blank(source)
    with gpusnap.Checkpointer(tmp_path, config=_config()) as ck:
        stats = ck.restore(target, verify="stream").stats
    assert _equal(target, source) and stats["proc_batches"] == 0
    assert any(isinstance(e, read_procs.ReaderDied) and "answered 42" in str(e) for e in calls.errors())


def test_without_shared_memory_the_restore_reads_in_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """memfd_create present but refused (seccomp, gVisor): a warning, then threads."""
    import errno

    source = _state()
    _save(tmp_path, source)

    def refuse(*args: Any) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "memfd_create", refuse)
    target = _blank(source)
    with gpusnap.Checkpointer(tmp_path, config=_config()) as ck:
        with pytest.warns(RuntimeWarning, match="shared memory"):
            stats = ck.restore(target, verify="stream").stats
    assert stats["reader_procs"] == 0 and _equal(target, source)


def test_shared_memory_outlives_its_pool_while_a_region_is_alive() -> None:
    """The mapping goes only with the last tensor over it (no write into unmapped memory)."""
    import gc

    pool = SlotPool(3, 4096, pinned=False, shared=True)
    region = pool.acquire()
    fd = pool.shared.fd
    del pool
    gc.collect()
    region.fill_(7)
    assert int(region.sum()) == 7 * 4096 and os.path.exists(f"/proc/self/fd/{fd}")
    del region
    gc.collect()
    assert not os.path.exists(f"/proc/self/fd/{fd}"), "unmapped and closed with the last region"


def test_close_does_not_wait_for_a_worker_whose_pipe_a_fork_holds(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked child of the program holds the workers' stdin open: close() kills them. The
    child holds them until it is killed, so a close() that waited for the workers' end of
    input would never return."""
    import threading

    monkeypatch.setattr(read_procs, "CLOSE_TIMEOUT_S", 0.2)
    pool = SlotPool(1, 4096, pinned=False, shared=True)
    procs = read_procs.ReaderProcs(2, pool)
    data = tmp_path / "d"
    data.write_bytes(b"x" * 10)
    assert procs.read(0, [(str(data), 0, 10, 0)]) == [10]
    workers = list(procs._procs)
    child = os.fork()
    if child == 0:  # holds every inherited fd until killed
        signal.pause()
        os._exit(0)
    try:
        closing = threading.Thread(target=procs.close, daemon=True)
        closing.start()
        closing.join(HANG_S)
        assert not closing.is_alive(), "close() waited for workers a fork keeps alive"
        assert all(p.returncode == -signal.SIGKILL for p in workers), [p.returncode for p in workers]
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_setup_times_say_where_a_first_restore_spends_before_reading(tmp_path: Path) -> None:
    """handle.stats["setup"]: one entry per step, eager and lazy."""
    source = _state()
    _save(tmp_path, source)
    steps = {"plan_s", "regions_s", "procs_s", "loader_s", "prepare_s"}
    with gpusnap.Checkpointer(tmp_path, config=_config()) as ck:
        first = ck.restore(_blank(source), verify="stream").stats["setup"]
        second = ck.restore(_blank(source), verify="stream").stats["setup"]
        handle = ck.restore(_blank(source), verify="stream", lazy=True)
        handle.wait()
        lazy = handle.stats["setup"]
    assert set(first) == steps and set(second) == steps and set(lazy) == steps
    assert all(v >= 0 for v in [*first.values(), *second.values(), *lazy.values()])


def test_shared_regions_are_one_per_process_not_per_core(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With reader processes the loader runs one thread per process (at most PROC_READERS):
    regions for more readers would only be page-locked for nothing (a fresh process pays for
    every one of them before its first read)."""
    monkeypatch.setattr(restorer_mod, "reader_threads", lambda io_threads: 32)
    monkeypatch.setattr(restorer_mod, "PROC_READERS", 3)
    state = {f"t{i}": torch.randn(4096) for i in range(40)}  # 40 pieces: more than 32 readers could take
    _save(tmp_path, state)
    target = _blank(state)
    with gpusnap.Checkpointer(tmp_path, config=_config()) as ck:
        stats = ck.restore(target, verify="stream").stats
        assert ck._restorer._slots.slots == 3 + restorer_mod.EXTRA_REGIONS
    assert stats["reader_procs"] == 3 and _equal(target, state)


def test_a_process_first_used_long_after_it_started_is_not_killed(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes are kept across restores: one may get its first request long after it
    started. It still has START_TIMEOUT_S from then to say ready (found by review: it was
    killed at once, and reader processes turned off for good). "Long after" on a clock the
    test moves: the processes get a generous start timeout of real time."""
    import time
    import types

    ahead = [0.0]
    clock = types.SimpleNamespace(monotonic=lambda: time.monotonic() + ahead[0])
    monkeypatch.setattr(read_procs, "time", clock)
    data = tmp_path / "data"
    data.write_bytes(b"x" * 4096)
    pool = SlotPool(2, 4096, pinned=False, shared=True)
    procs = read_procs.ReaderProcs(2, pool)
    procs.start_timeout = HANG_S
    try:
        assert procs.read(0, [(str(data), 0, 10, 0)]) == [10]
        ahead[0] = 1.5 * HANG_S  # past the start timeout since the processes started
        assert procs.read(1, [(str(data), 0, 10, 0)]) == [10]
        assert not procs.start_failed
    finally:
        procs.close()
