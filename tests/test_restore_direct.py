"""Direct copies (restore/pipeline/sources/direct_copies.py, direct_worker.py): helper
processes copy device-checked batches from the page cache into landing slots, and the copy
thread checks them there.

On CPU the helpers run their memfd backend (the landing buffer is shared memory, the copy a
memmove from the same read-only map the CUDA backend page-locks), with the device check
forced on CPU tensors: every byte, every fallback and every landing slot's return are checked
here in CI. The CUDA backend runs in the ``cuda`` tests."""

from __future__ import annotations

import marshal
import os
import signal
import struct
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from restore_support import add_device_hashes, corrupt_chunk, loader_batches, tiny_config
from restore_support import blank_like as _blank
from restore_support import mixed_state as _state
from restore_support import states_equal as _equal

import gpusnap
from gpusnap import IntegrityError
from gpusnap.restore import restorer as restorer_mod
from gpusnap.restore.pipeline.sources import direct_copies as direct_mod
from gpusnap.restore.pipeline.sources import direct_worker
from gpusnap.restore.pipeline.staging import can_share

pytestmark = pytest.mark.skipif(not can_share(), reason="direct copies need memfd (Linux)")

CS = 512
PIECE = 8 * CS
HANG_S = 120.0  # waits that end only on a hang: a test then fails instead of blocking the suite


def _config(**kw: Any) -> gpusnap.Config:
    kw.setdefault("restore_direct_copies", "on")
    kw.setdefault("restore_verify_on_device", "on")
    kw.setdefault("restore_reader_processes", "off")
    return tiny_config(io_threads=3, staging_bytes=64 * CS, restore_piece_bytes=PIECE, **kw)


def _save(root: Path, state: dict[str, Any]) -> str:
    with gpusnap.Checkpointer(root, config=_config()) as ck:
        cid = ck.save(state, blocking=True).wait().id
    add_device_hashes(root, cid)
    return cid


def _ready(ck: gpusnap.Checkpointer, timeout: float = 60.0) -> direct_mod.DirectCopies:
    """The Checkpointer's helpers, once every one has said ready (a first restore starts them)."""
    direct = ck._restorer._direct
    assert direct is not None, "no direct-copy helpers were started"
    assert direct.wait_ready(timeout), "the helpers did not start"
    return direct


@pytest.mark.parametrize("lazy", [False, True])
def test_every_checked_batch_lands_directly_and_every_byte_arrives(tmp_path: Path, lazy: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    source = _state()
    _save(tmp_path, source)
    with gpusnap.Checkpointer(tmp_path, config=_config()) as ck:
        first = _blank(source)
        ck.restore(first, verify="stream", lazy=lazy).wait()  # starts the helpers; stages on the host meanwhile
        direct = _ready(ck)
        seen = loader_batches(monkeypatch, lambda ls: ls.device_check)
        target = _blank(source)
        handle = ck.restore(target, verify="stream", lazy=lazy)
        if lazy:  # ops during the load see restored values
            assert torch.equal(target["big4"] * 2, source["big4"] * 2)
        handle.wait()
        stats = handle.stats
        assert direct.procs.alive() and ck._restorer._direct is direct, "kept across restores"
        assert direct.landing.available() == len(direct) * direct_mod.DEPTH, "every landing slot came back"
        pids = [p.pid for p in direct.procs._procs]
    assert _equal(first, source) and _equal(target, source)
    assert stats["direct_helpers"] == len(pids)
    assert stats["direct_batches"] == len(seen) > 0 and stats["direct_fallbacks"] == 0
    assert stats["host_verified_bytes"] == 40 * 30 * 4  # only the transposed t, read whole, is hashed on the host
    for pid in pids:  # close() ended them
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_auto_uses_no_helpers_for_cpu_targets(tmp_path: Path) -> None:
    source = _state()
    _save(tmp_path, source)
    target = _blank(source)
    with gpusnap.Checkpointer(tmp_path, config=_config(restore_direct_copies="auto")) as ck:
        stats = ck.restore(target, verify="stream").stats
        assert ck._restorer._direct is None
    assert stats["direct_helpers"] == 0 and _equal(target, source)


def test_verify_off_and_host_checks_use_no_helpers(tmp_path: Path) -> None:
    """Only device-checked batches land directly: nothing else checks them on the way."""
    source = _state()
    _save(tmp_path, source)
    with gpusnap.Checkpointer(tmp_path, config=_config(restore_verify_on_device="off")) as ck:
        target = _blank(source)
        stats = ck.restore(target, verify="stream").stats
        assert ck._restorer._direct is None
        stats_off = ck.restore(_blank(source), verify="off").stats
    assert stats["direct_batches"] == 0 and stats_off["direct_batches"] == 0 and _equal(target, source)


def test_a_helper_killed_mid_restore_costs_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first request kills its helper: that thread stages on the host from then on, the
    other helpers keep copying."""
    source = _state()
    _save(tmp_path, source)
    real = direct_mod.DirectCopies.copy
    killed: list[int] = []
    claim = threading.Lock()  # taken once, for good: exactly one helper is killed
    other_copied = threading.Event()

    def kill_first(self: direct_mod.DirectCopies, k: int, runs: list[tuple[str, int, int, int]]) -> Any:
        if not claim.acquire(blocking=False):
            answer = real(self, k, runs)
            other_copied.set()
            return answer
        proc = self.procs._procs[k]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed.append(proc.pid)
        # holds this batch until another helper has copied one: however the threads are
        # scheduled, the others take batches meanwhile (the wait only guards against a hang)
        other_copied.wait(HANG_S)
        return real(self, k, runs)

    with gpusnap.Checkpointer(tmp_path, config=_config()) as ck:
        ck.restore(_blank(source), verify="stream")
        direct = _ready(ck)
        monkeypatch.setattr(direct_mod.DirectCopies, "copy", kill_first)
        target = _blank(source)
        stats = ck.restore(target, verify="stream").stats
        assert direct.landing.available() == len(direct) * direct_mod.DEPTH
        target2 = _blank(source)
        ck.restore(target2, verify="stream")  # new helpers (one was dead)
        assert ck._restorer._direct is not direct
    assert len(killed) == 1 and other_copied.is_set()
    assert stats["direct_fallbacks"] >= 1 and stats["direct_batches"] >= 1
    assert _equal(target, source) and _equal(target2, source)


def test_a_helper_whose_copy_fails_is_dropped_and_the_batch_staged(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper that answers a CUDA error (here: every request, as a broken context would) is
    killed; its batches go through host memory, checked the same way. Such an error would
    recur (a driver without read-only page-locking, say): the next restore warns and starts
    no helpers."""
    source = _state()
    _save(tmp_path, source)
    with gpusnap.Checkpointer(tmp_path, config=_config()) as ck:
        ck.restore(_blank(source), verify="stream")
        direct = _ready(ck)
        real = direct.procs.request
        monkeypatch.setattr(direct.procs, "request", lambda k, msg: (real(k, msg), ("cuda", "copy failed: CUDA error 700"))[1])
        target = _blank(source)
        stats = ck.restore(target, verify="stream").stats
        assert not direct.procs.alive()
        target2 = _blank(source)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stats2 = ck.restore(target2, verify="stream").stats
        assert ck._restorer._direct is None and ck._restorer.direct_copies == "off"
    assert stats["direct_batches"] == 0 and stats["direct_fallbacks"] >= 1 and _equal(target, source)
    assert any("direct-copy helper failed (copy failed: CUDA error 700)" in str(w.message) for w in caught)
    assert stats2["direct_helpers"] == 0 and _equal(target2, source)


def test_a_corrupt_chunk_never_lands_and_is_named(tmp_path: Path) -> None:
    source = _state()
    _save(tmp_path, source)
    corrupt_chunk(tmp_path, source["big3"].numpy().tobytes()[:64], 9)
    with gpusnap.Checkpointer(tmp_path, config=_config()) as ck:
        with pytest.raises(IntegrityError, match=r"big3.*does not match its device hash"):
            ck.restore(_blank(source), verify="stream")
        direct = _ready(ck)
        target = _blank(source)
        with pytest.raises(IntegrityError, match=r"big3.*does not match its device hash.*not written"):
            ck.restore(target, verify="stream")
        assert direct.landing.available() == len(direct) * direct_mod.DEPTH, "landing slots back after the failure"
    assert torch.count_nonzero(target["big3"]) == 0 or not torch.equal(target["big3"], source["big3"])


def test_a_truncated_pack_is_reported_as_without_helpers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The helper sees the run past the end of the file, copies nothing, and the thread reads
    the batch itself and names the chunk."""
    source = _state()
    _save(tmp_path, source)
    replies: list[Any] = []
    real = direct_mod.DirectCopies.copy

    def copy(self: direct_mod.DirectCopies, k: int, runs: list[tuple[str, int, int, int]]) -> Any:
        got, after = real(self, k, runs)
        replies.append([(g, r[2]) for g, r in zip(got, runs)])
        return got, after

    monkeypatch.setattr(direct_mod.DirectCopies, "copy", copy)
    with gpusnap.Checkpointer(tmp_path, config=_config()) as ck:
        ck.restore(_blank(source), verify="stream")
        _ready(ck)
        packs = sorted((tmp_path / "packs").rglob("*.pack"), key=lambda p: p.stat().st_size)
        with open(packs[-1], "r+b") as f:
            f.truncate(packs[-1].stat().st_size // 2)
        with pytest.raises(IntegrityError, match=r"truncated"):
            ck.restore(_blank(source), verify="stream")
    assert any(any(g < n for g, n in r) for r in replies), "the helper saw the short run"


def test_helpers_that_cannot_start_turn_direct_copies_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _state()
    _save(tmp_path, source)
    monkeypatch.setattr(direct_mod, "WORKER", str(tmp_path / "no-such-worker.py"))
    target = _blank(source)
    with gpusnap.Checkpointer(tmp_path, config=_config()) as ck:
        ck.restore(_blank(source), verify="stream")
        direct = ck._restorer._direct
        for proc in direct.procs._procs:  # (no script to run: each exits at once)
            proc.wait(HANG_S)
        with pytest.raises(Exception):
            direct.ready(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stats = ck.restore(target, verify="stream").stats
        assert ck._restorer._direct is None and ck._restorer.direct_copies == "off"
    assert any("direct-copy helper did not start" in str(w.message) for w in caught)
    assert stats["direct_batches"] == 0 and _equal(target, source)


def test_the_env_override_forces_helpers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(restorer_mod, "DIRECT_COPIES", "off")
    source = _state()
    _save(tmp_path, source)
    with gpusnap.Checkpointer(tmp_path, config=_config()) as ck:
        ck.restore(_blank(source), verify="stream")
        assert ck._restorer._direct is None


def test_config_rejects_unknown_modes() -> None:
    with pytest.raises(ValueError, match="restore_direct_copies"):
        gpusnap.Config(restore_direct_copies="yes")


# -- the worker alone -------------------------------------------------------------------------
def test_page_spans_merge_overlapping_and_touching_pages() -> None:
    page = direct_worker.PAGE
    assert direct_worker.page_spans([(0, 10), (5, 3)]) == [(0, page)]
    assert direct_worker.page_spans([(page - 1, 2)]) == [(0, 2 * page)]
    assert direct_worker.page_spans([(3 * page, 1), (0, page)]) == [(0, page), (3 * page, 4 * page)]
    assert direct_worker.page_spans([(0, page), (page, 1)]) == [(0, 2 * page)]  # touching: one lock


def _worker(job: dict[str, Any], requests: list[Any], pass_fds: tuple[int, ...] = ()) -> list[Any]:
    LEN = struct.Struct("<Q")
    body = b"".join(LEN.pack(len(m)) + m for m in (marshal.dumps(x) for x in [job, *requests]))
    w = subprocess.run([sys.executable, "-I", "-S", direct_worker.__file__], input=body, capture_output=True,
                       pass_fds=pass_fds, timeout=60)
    out, replies = w.stdout, []
    while out:
        (n,) = LEN.unpack(out[:8])
        replies.append(marshal.loads(out[8 : 8 + n]))
        out = out[8 + n :]
    return replies


def test_worker_copies_runs_and_reports_errors(tmp_path: Path) -> None:
    data = tmp_path / "data"
    content = bytes(range(256)) * 64  # 16 KiB
    data.write_bytes(content)
    fd = os.memfd_create("landing")
    os.ftruncate(fd, 8192)
    page = direct_worker.PAGE
    runs = [(str(data), 10, 100, 0), (str(data), 11, 50, 200), (str(data), 2 * page + 3, 7, 4000)]
    replies = _worker({"backend": "memfd", "fd": fd, "nbytes": 8192},
                      [runs, [(str(data), len(content) - 5, 50, 0)], [(str(tmp_path / "gone"), 0, 10, 0)],
                       [(str(data), 0, 10, 8190)]], pass_fds=(fd,))
    landing = os.pread(fd, 8192, 0)
    os.close(fd)
    assert replies[0] == ("ready", page, [])
    assert replies[1] == ("ok", [100, 50, 7], -1)  # overlapping runs: their pages locked once; copied on return
    assert landing[:100] == content[10:110] and landing[200:250] == content[11:61]
    assert landing[4000:4007] == content[2 * page + 3 : 2 * page + 10]
    assert replies[2] == ("ok", [5], -1)  # past the end: nothing copied
    assert replies[3][0] == "error" and replies[3][3] == str(tmp_path / "gone")
    assert replies[4][0] == "cuda" and len(replies) == 5  # outside the landing buffer: it stops


def test_worker_reports_a_start_that_failed(tmp_path: Path) -> None:
    replies = _worker({"backend": "cuda", "lib": str(tmp_path / "libcudart.so"), "device": 0, "handle": "00" * 64,
                       "offset": 0}, [])
    assert replies and replies[0][0] == "failed"


# -- CUDA ---------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("lazy", [False, True])
def test_cuda_direct_copies_restore_every_byte(tmp_path: Path, lazy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setattr(restorer_mod, "DIRECT_MIN_BYTES", 0)  # (auto skips restores this small)
    dev = torch.device("cuda", torch.cuda.current_device())
    source = _state(dev)
    with gpusnap.Checkpointer(tmp_path, config=_config(restore_verify_on_device="auto")) as ck:
        ck.save(source, blocking=True).wait()
    config = _config(restore_direct_copies="auto", restore_verify_on_device="auto", device_check_min_bytes=CS)
    with gpusnap.Checkpointer(tmp_path, config=config) as ck:
        ck.restore(_blank(source), verify="stream").wait()
        direct = _ready(ck)
        assert direct.device == dev
        target = _blank(source)
        handle = ck.restore(target, verify="stream", lazy=lazy)
        if lazy:
            assert torch.equal(target["big2"] + 1, source["big2"] + 1)
        handle.wait()
        torch.cuda.synchronize()
        assert direct.landing.available() == len(direct) * direct_mod.DEPTH
    assert _equal(target, source)
    assert handle.stats["direct_batches"] > 0 and handle.stats["direct_fallbacks"] == 0


@pytest.mark.cuda
def test_cuda_auto_leaves_small_restores_to_the_host_path(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    source = _state(torch.device("cuda"))
    with gpusnap.Checkpointer(tmp_path, config=_config(restore_verify_on_device="auto")) as ck:
        ck.save(source, blocking=True).wait()
    with gpusnap.Checkpointer(tmp_path, config=_config(restore_direct_copies="auto")) as ck:
        target = _blank(source)
        ck.restore(target, verify="stream")
        assert ck._restorer._direct is None
    assert _equal(target, source)


def test_failures_never_hang_a_reader_waiting_for_a_landing_slot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One helper (two landing slots), three readers, a corrupt chunk, restored again and
    again: when the check fails while the copy thread holds both landing slots and a reader
    waits for one, the slots must go back before the copy thread waits for the readers' end,
    or that reader never ends. (Found by review; the old code hung within 5-17 tries here.
    A race: each try hits it or not, so the test makes many.)"""

    monkeypatch.setattr(restorer_mod, "DIRECT_HELPERS", 1)
    source = _state()
    _save(tmp_path, source)
    corrupt_chunk(tmp_path, source["big3"].numpy().tobytes()[:64], 9)
    with gpusnap.Checkpointer(tmp_path, config=_config()) as ck:
        with pytest.raises(IntegrityError):
            ck.restore(_blank(source), verify="stream")
        direct = _ready(ck)
        for _ in range(60):
            outcome: list[BaseException | None] = []

            def go() -> None:
                try:
                    ck.restore(_blank(source), verify="stream")
                    outcome.append(None)
                except BaseException as exc:  # noqa: BLE001
                    outcome.append(exc)

            t = threading.Thread(target=go, daemon=True)
            t.start()
            t.join(HANG_S)
            assert not t.is_alive(), "the restore hung"
            assert isinstance(outcome[0], IntegrityError)
            assert direct.landing.available() == len(direct) * direct_mod.DEPTH


# -- the copy thread after a failure ------------------------------------------------------------
class _StickyStream:
    """A CUDA stream after a sticky error (an illegal address, say): every wait raises."""

    def synchronize(self) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.mark.parametrize("fail_in", ["handle", "none"])
def test_a_broken_device_still_ends_the_load_and_gives_every_region_back(monkeypatch: pytest.MonkeyPatch,
                                                                          fail_in: str) -> None:
    """The copy thread's waits in ``_drain`` and ``_finish`` may raise once the device is
    broken: the thread must still give every region back and report, or a reader waiting
    for a region and every waiter on the load hang (found by review)."""
    from gpusnap.restore.pipeline.copier import Copier
    from gpusnap.restore.pipeline.sources.source import Region
    from gpusnap.restore.pipeline.staging import SlotPool

    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)  # (a CPU stand-in for the stream)

    class Schedule:
        error = None

        def fail(self, exc: BaseException) -> None:
            self.error = exc

    class Stats:
        def add(self, **kw: float) -> None:
            pass

    pool = SlotPool(1, 4096, pinned=False)
    closed: list[BaseException | None] = []
    copier = Copier(None, None, Schedule(), {torch.device("cuda", 0): _StickyStream()}, None,  # type: ignore[arg-type]
                    Stats(), lambda i: "", closed.append)

    def handle(item: Any) -> None:
        copier._holding = item  # ("none": still held when the load ends, given back by _finish)
        if fail_in == "handle":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    # private: on CPU no public seam fails the copy thread mid-batch, or holds a region to the end
    monkeypatch.setattr(copier, "_handle", handle)
    region = Region([], pool.acquire(), pool)
    copier.start()
    copier.put(region)  # the only region: handed over, then the copy thread fails
    got: list[torch.Tensor] = []
    reader = threading.Thread(target=lambda: got.append(pool.acquire()), daemon=True)
    reader.start()
    copier.put_end()
    reader.join(HANG_S)
    assert copier.thread is not None
    copier.thread.join(HANG_S)
    assert not reader.is_alive() and got, "the region came back"
    assert not copier.thread.is_alive() and len(closed) == 1 and isinstance(closed[0], RuntimeError)
