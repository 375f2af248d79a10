"""Promotions in a helper process (``Config.promotion_process``, ``storage/promote_process.py``).

On CPU the helper hashes on the host, as the threads do; the protocol, the commit gate, the
fallbacks and the ends of either side are the same as with a GPU.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fast_support import CFG, HANG_S, blank_state, cfg, make_state, roots, same, saved_for_promotion, snapshot
from helper_faults import faulty_python

import gpusnap
from gpusnap.storage.fast_tier import chunk_location, slab_path
from gpusnap.storage.promote import CancelToken, PromotionCancelled, gather_small, promote
from gpusnap.storage.promote_process import HelperUnavailable, PromotionProcess
from gpusnap.storage.repository import Repository

ON = cfg(promotion_process="on")


def _flip(fast: Path, name: str) -> None:
    """One byte of chunk ``name`` changed in its slab file."""
    _h, slab, offset, _n = chunk_location(name)
    with open(fast / slab_path(slab), "r+b") as f:
        f.seek(offset + 5)
        byte = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([byte[0] ^ 0x40]))


@contextmanager
def helper() -> Iterator[PromotionProcess]:
    process = PromotionProcess(ON)
    try:
        yield process
    finally:
        process.close()


@pytest.fixture(autouse=True)
def _earlier_helpers() -> Iterator[None]:
    """Helpers an earlier test left (it failed) are not this test's."""
    _LEFT.clear()
    _LEFT.update(_helper_pids(mine=False))
    yield


_LEFT: set[int] = set()


def _helper_pids(*, mine: bool = True) -> list[int]:
    """This process's children that are promotion helpers (``mine``: started by this test)."""
    pids = []
    for tid in os.listdir("/proc/self/task"):
        try:
            kids = Path(f"/proc/self/task/{tid}/children").read_text().split()
        except OSError:
            continue
        for pid in kids:
            try:
                if b"promote_worker" in Path(f"/proc/{pid}/cmdline").read_bytes() and not (mine and int(pid) in _LEFT):
                    pids.append(int(pid))
            except OSError:
                continue
    return pids


def _gone(pid: int) -> bool:
    """Waits (up to HANG_S) for process ``pid`` to end; whether it did."""
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.01)
    return False


def test_config_promotion_process_is_checked() -> None:
    with pytest.raises(ValueError, match="promotion_process"):
        gpusnap.Config(promotion_process="yes")


def test_the_helper_commits_the_checkpoint_the_threads_would(tmp_path: Path) -> None:
    durable, _fast, tier, manifest, _runs = saved_for_promotion(tmp_path)
    other = tmp_path / "by-threads"
    by_threads = promote(tier, manifest, Repository.open(other, create=True, config=CFG))
    repo = Repository.open(durable, create=True, config=CFG)
    with helper() as process:
        promoted = process.promote(tier, manifest, repo, extra_stats={"promoted_in": "helper"}, cancel=CancelToken(),
                                   workers=2)
        assert process.cpu_s > 0
    assert promoted.id == manifest.id and promoted.stats["promoted_in"] == "helper"
    assert promoted.storages == by_threads.storages  # (the same chunks, named the same)
    assert [m.id for m in Repository.open(durable).list()] == [manifest.id]
    target = blank_state(make_state(3, width=256))
    with gpusnap.Checkpointer(durable, config=cfg(memory_tier="off")) as ck:
        ck.restore(target, manifest.id)
    assert same(snapshot(target), snapshot(make_state(3, width=256))) == []


@pytest.mark.parametrize("where", ["gathered", "run"])
def test_a_corrupt_chunk_fails_the_helpers_promotion_and_commits_nothing(tmp_path: Path, where: str) -> None:
    durable, fast, tier, manifest, runs = saved_for_promotion(tmp_path)
    gathered = gather_small([n for e in manifest.storages for n in e.chunks], CFG.chunk_size)[0]
    bad = gathered[len(gathered) // 2] if where == "gathered" else runs[1][0]
    _flip(fast, bad)
    repo = Repository.open(durable, create=True, config=CFG)
    with helper() as process:
        with pytest.raises(gpusnap.IntegrityError, match=bad.split("@")[0]):
            process.promote(tier, manifest, repo, cancel=CancelToken(), workers=2)
    assert Repository.open(durable).list() == []


class _CancelAtCommit(CancelToken):
    """Called off at the very moment the helper asks to commit."""

    @contextmanager
    def committing(self, checkpoint_id: str) -> Iterator[None]:
        self.cancel()
        with super().committing(checkpoint_id):
            yield


@pytest.mark.parametrize("when", ["before", "at_commit"])
def test_a_promotion_called_off_commits_nothing_and_the_helper_goes_on(tmp_path: Path, when: str) -> None:
    durable, _fast, tier, manifest, _runs = saved_for_promotion(tmp_path)
    repo = Repository.open(durable, create=True, config=CFG)
    with helper() as process:
        token = CancelToken() if when == "before" else _CancelAtCommit()
        if when == "before":
            token.cancel()
        with pytest.raises(PromotionCancelled):
            process.promote(tier, manifest, repo, cancel=token, workers=2)
        assert Repository.open(durable).list() == []
        process.promote(tier, manifest, repo, cancel=CancelToken(), workers=2)  # (the same helper, next job)
    assert [m.id for m in Repository.open(durable).list()] == [manifest.id]


def test_a_program_killed_while_its_helper_waits_to_commit_gets_no_commit(tmp_path: Path) -> None:
    durable, fast, _tier, manifest, _runs = saved_for_promotion(tmp_path)
    pid_file = tmp_path / "helper.pid"
    script = textwrap.dedent(f"""
        import dataclasses, os, signal, sys
        from contextlib import contextmanager
        sys.path[:0] = {sys.path!r}
        from fast_support import CFG
        from gpusnap.storage.fast_tier import FastTier
        from gpusnap.storage.promote import CancelToken
        from gpusnap.storage.promote_process import PromotionProcess
        from gpusnap.storage.repository import Repository
        
        class Die(CancelToken):
            @contextmanager
            def committing(self, checkpoint_id):
                kids = [k for t in os.listdir("/proc/self/task")
                        for k in open(f"/proc/self/task/{{t}}/children").read().split()]
                open({str(pid_file)!r}, "w").write(" ".join(kids))
                os.kill(os.getpid(), signal.SIGKILL)
                yield

        tier = FastTier.open({str(fast)!r})
        repo = Repository.open({str(durable)!r}, create=True, config=CFG)
        PromotionProcess(dataclasses.replace(CFG, promotion_process="on")).promote(
            tier, tier.load_manifest({manifest.id!r}), repo, cancel=Die(), workers=2)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == -signal.SIGKILL, done.stderr
    (pid,) = [int(p) for p in pid_file.read_text().split()]
    assert _gone(pid), "the helper outlived its program"
    assert Repository.open(durable).list() == []


def test_a_helper_that_cannot_start_leaves_promotions_to_the_threads_with_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    durable, fast = roots(tmp_path)
    caplog.set_level(logging.WARNING, logger="gpusnap")
    with gpusnap.Checkpointer(durable, fast_root=fast, promote_every=1, config=ON) as ck:
        for seed in (1, 2):
            ck.save(make_state(seed)).wait()
            ck.wait()
    durable_list = Repository.open(durable).list()
    assert len(durable_list) == 2 and {m.stats["promoted_in"] for m in durable_list} == {"threads"}
    warned = [r for r in caplog.records if "program's threads from now on" in r.getMessage()]
    assert len(warned) == 1 and "could not start" in warned[0].getMessage()


def test_a_helper_killed_between_promotions_leaves_the_next_to_the_threads(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    durable, fast = roots(tmp_path)
    caplog.set_level(logging.WARNING, logger="gpusnap")
    with gpusnap.Checkpointer(durable, fast_root=fast, promote_every=1, config=ON) as ck:
        first = ck.save(make_state(1)).wait()
        ck.wait()
        (pid,) = _helper_pids()
        os.kill(pid, signal.SIGKILL)
        assert _gone(pid)
        second = ck.save(make_state(2)).wait()
        ck.wait()
    by_id = {m.id: m for m in Repository.open(durable).list()}
    assert by_id[first.id].stats["promoted_in"] == "helper"
    assert by_id[second.id].stats["promoted_in"] == "threads"
    assert any("program's threads from now on" in r.getMessage() for r in caplog.records)
    for info, seed in ((first, 1), (second, 2)):
        target = blank_state(make_state(seed))
        with gpusnap.Checkpointer(durable, config=cfg(memory_tier="off")) as reader:
            reader.restore(target, info.id)
        assert same(snapshot(target), snapshot(make_state(seed))) == []


def test_the_default_memory_tier_promotes_in_the_helper_when_asked(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with gpusnap.Checkpointer(root, config=cfg(promotion_process="on", memory_tier="auto")) as ck:  # (conftest.py: where)
        info = ck.save(make_state(4)).wait()
        ck.wait()
    (m,) = Repository.open(root).list()
    assert m.id == info.id and m.stats["promoted_in"] == "helper"
    assert _helper_pids() == []  # (closed with its Checkpointer)


def test_gc_waits_for_a_write_transaction_running_elsewhere_even_while_its_own_are_open(tmp_path: Path) -> None:
    """A helper's transaction is invisible to the program's pins: with one running, the
    program's gc may not fall back on its own pins (it would delete what the helper reuses)."""
    root = tmp_path / "root"
    with gpusnap.Checkpointer(root, keep_last=None, config=cfg(memory_tier="off")) as ck:
        for seed in (1, 2):
            ck.save(make_state(seed)).wait()
    repo = Repository.open(root, create=True, config=CFG)
    first = repo.list()[0].id
    txn = repo.begin_write()  # (the program's own: its shared lock keeps gc from the exclusive one)
    try:
        with repo.writing_elsewhere():
            report = repo.gc(keep_last=1, blocking=False)
            assert report.skipped and [m.id for m in Repository.open(root).list()][0] == first
        report = repo.gc(keep_last=1, blocking=False)  # (none elsewhere: its pins cover its own)
        assert not report.skipped and report.deleted_checkpoints == (first,)
    finally:
        txn.abort()
        repo.close()


@pytest.mark.parametrize("mode", ["off", "on"])
def test_a_tag_the_helper_committed_is_taken_for_the_program(tmp_path: Path, mode: str) -> None:
    durable, fast = roots(tmp_path)
    with gpusnap.Checkpointer(durable, fast_root=fast, fast_keep_last=1, keep_last=None,
                              config=cfg(promotion_process=mode)) as ck:
        ck.save(make_state(1), tag="best", promote=True).wait()
        ck.wait()
        ck.save(make_state(2)).wait()  # (fast retention lets "best" go from the fast tier)
        ck.wait()
        with pytest.raises(gpusnap.CheckpointError, match="tag 'best' already names"):
            ck.save(make_state(3), tag="best", promote=True)
    assert [m.tag for m in Repository.open(durable).list()].count("best") == 1


def test_a_checkpoint_error_in_the_helper_is_the_promotions_failure_and_the_helper_stays(tmp_path: Path) -> None:
    """The helper reads the checkpoint's manifest from the tier; here it is gone from there:
    the threads would fail too (their caller's manifest aside), so it is the promotion's failure."""
    durable, fast, tier, manifest, _runs = saved_for_promotion(tmp_path)
    (fast / "manifests" / f"{manifest.id}.json").unlink()
    repo = Repository.open(durable, create=True, config=CFG)
    with helper() as process:
        with pytest.raises(gpusnap.CheckpointNotFoundError):
            process.promote(tier, manifest, repo, cancel=CancelToken(), workers=2)
        token = CancelToken()
        token.cancel()  # (a delete() racing the promotion: called off, whatever the helper met)
        with pytest.raises(PromotionCancelled):
            process.promote(tier, manifest, repo, cancel=token, workers=2)
        assert len(_helper_pids()) == 1  # (the same helper serves on)


def test_a_failure_of_the_helpers_own_leaves_the_promotion_to_the_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(sys, "executable", faulty_python(tmp_path))
    durable, fast = roots(tmp_path)
    caplog.set_level(logging.WARNING, logger="gpusnap")
    with gpusnap.Checkpointer(durable, fast_root=fast, promote_every=1, config=ON) as ck:
        infos = [ck.save(make_state(seed)).wait() for seed in (1, 2)]
        ck.wait()
    by_id = {m.id: m for m in Repository.open(durable).list()}
    assert [by_id[i.id].stats["promoted_in"] for i in infos] == ["threads", "threads"]
    warned = [r.getMessage() for r in caplog.records if "program's threads from now on" in r.getMessage()]
    assert len(warned) == 1 and "RuntimeError: injected into the helper" in warned[0]
    assert _helper_pids() == []


def test_a_gc_on_its_own_pins_and_a_transaction_elsewhere_exclude_each_other(tmp_path: Path) -> None:
    repo = Repository.open(tmp_path / "root", create=True, config=CFG)
    try:
        with repo.writing_elsewhere():
            assert not repo.enter_pins_only_gc()  # (the pins do not name the helper's chunks)
        assert repo.enter_pins_only_gc()
        entered = threading.Event()

        def elsewhere() -> None:
            with repo.writing_elsewhere():
                entered.set()

        thread = threading.Thread(target=elsewhere)
        thread.start()
        repo.leave_pins_only_gc()  # (the helper's transaction starts once that gc is over)
        assert entered.wait(HANG_S)
        thread.join(HANG_S)
    finally:
        repo.close()
