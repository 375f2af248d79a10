"""Promotion never commits wrong bytes and never loses a checkpoint asked to be promoted: its
fast root removed under it, the checkpoint deleted meanwhile, its slab bytes changed while it
reads them, a failure followed by success, an explicit request among cadence ones, retention
under saves that never wait, and two runs on one fast root."""

from __future__ import annotations

import errno
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fast_support import (
    CFG,
    HANG_S,
    DurableGate,
    blank_state,
    cfg,
    durable_backend,
    hold_durable_writes,
    make_state,
    roots,
    same,
    snapshot,
    train,
)
from faults import FaultyBackend

import gpusnap
from gpusnap.storage.backend import LocalBackend
from gpusnap.storage.fast_tier import FastTier
from gpusnap.storage.promote import check_runs, gather_small
from gpusnap.storage.repository import Repository


@pytest.fixture
def durable_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[DurableGate]:
    """Promotions held in the durable store until the test releases them."""
    yield from hold_durable_writes(monkeypatch)


def _manifest_ids(root: Path) -> list[str]:
    return sorted(p.stem for p in (root / "manifests").glob("*.json")) if root.exists() else []


def _restored(root: Path, like: dict[str, Any], checkpoint: str) -> dict[str, Any]:
    """``checkpoint`` restored from ``root`` alone, every chunk verified."""
    target = blank_state(like)
    with gpusnap.Checkpointer(root) as ck:
        ck.restore(target, checkpoint, verify="upfront")
    return snapshot(target)


def test_a_promotion_in_flight_when_its_fast_root_is_removed_commits_the_bytes_it_was_asked_for(
    tmp_path: Path, durable_gate: DurableGate
) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(1)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, fast_keep_last=1) as ck:
        first = ck.save(state, promote=True).wait()
        expected = snapshot(state)
        durable_gate.wait_entered()  # the promotion has read its first run and waits to store it
        shutil.rmtree(fast)  # a cleaned /dev/shm: the next save makes a new tier at the same path
        later = []
        for step in range(2, 6):  # the new tier's saves and retention reuse its slab files' names
            train(state, step)
            later.append(ck.save(state).wait())
        durable_gate.release()
        ck.wait()  # nothing to raise: the promotion read the old tier's memory, not the new files
        assert first.id in [i.id for i in ck.list() if i.tier == "durable"]
    assert same(_restored(durable, state, first.id), expected) == []
    assert Repository.open(durable).verify().ok


@pytest.mark.parametrize("save_meanwhile", [False, True])
def test_delete_during_its_promotion_calls_the_promotion_off(
    tmp_path: Path, durable_gate: DurableGate, save_meanwhile: bool
) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(1)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, fast_keep_last=1) as ck:
        doomed = ck.save(state, tag="doomed", promote=True).wait()
        durable_gate.wait_entered()
        ck.delete("doomed")
        assert doomed.id not in [i.id for i in ck.list()]
        train(state, 2)
        if save_meanwhile:  # retention and this save reuse the deleted checkpoint's slab bytes
            kept = ck.save(state, promote=True).wait()
        durable_gate.release()
        if not save_meanwhile:
            ck.wait()
            kept = ck.save(state, promote=True).wait()
        expected = snapshot(state)
        ck.wait()  # called off, not failed: nothing raised
        assert [(i.id, i.tier) for i in ck.list()] == [(kept.id, "durable")]
        with pytest.raises(gpusnap.CheckpointNotFoundError):
            ck.restore(blank_state(state), "doomed")
    assert _manifest_ids(durable) == [kept.id]  # never committed after its delete
    assert same(_restored(durable, state, kept.id), expected) == []
    assert Repository.open(durable).verify().ok


def test_slab_bytes_that_change_while_a_promotion_writes_them_fail_it_and_reach_no_root(
    tmp_path: Path, durable_gate: DurableGate
) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(1)
    with pytest.raises(gpusnap.StorageError, match="does not match its hash"):  # (raised by wait(), once)
        with gpusnap.Checkpointer(durable, fast_root=fast, config=cfg(io_threads=1)) as ck:
            info = ck.save(state, promote=True).wait()
            durable_gate.wait_entered()  # the first run's first chunk waits to be written
            manifest = FastTier.open(fast).load_manifest(info.id)
            every = [n for e in manifest.storages for n in e.chunks]
            first_run = check_runs(gather_small(every, CFG.chunk_size)[1], CFG.chunk_size)[0]  # (read from the slab)
            for name in first_run:  # another process scribbles over the run's slab bytes
                where, length = name.split("@")[1], int(name.split(":")[-1])
                slab, offset = (int(x) for x in where.split(":")[:2])
                with open(fast / "slabs" / f"{slab:06d}.slab", "r+b") as f:
                    f.seek(offset)
                    f.write(bytes(255 - (i % 256) for i in range(length)))
            durable_gate.release()
            try:
                ck.wait()
            finally:
                assert info.id not in [i.id for i in Repository.open(durable).list()] \
                    if (durable / "manifests").is_dir() else True  # (the written bytes were checked: refused)


def test_small_chunks_are_written_from_the_copy_they_were_checked_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(1)
    expected = snapshot(state)
    copy_checked = FastTier.copy_checked
    scribbled: list[str] = []

    def then_scribbled(tier: FastTier, names: list[str]) -> bytearray:
        copy = copy_checked(tier, names)
        for name in names:  # another process scribbles over their slab bytes as soon as they are checked
            where, length = name.split("@")[1], int(name.split(":")[-1])
            slab, offset = (int(x) for x in where.split(":")[:2])
            with open(fast / "slabs" / f"{slab:06d}.slab", "r+b") as f:
                f.seek(offset)
                f.write(bytes(255 - (i % 256) for i in range(length)))
        scribbled.extend(names)
        return copy

    monkeypatch.setattr(FastTier, "copy_checked", then_scribbled)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        info = ck.save(state, promote=True).wait()
        ck.wait()
    assert scribbled
    assert _manifest_ids(durable) == [info.id]
    assert same(_restored(durable, state, info.id), expected) == []  # the bytes of the save, not the scribble


class _FullOnce(FaultyBackend):
    """A durable root whose disk is full for the first ``failures`` pack writes, then has room."""

    def __init__(self, inner: Any, failures: int = 1) -> None:
        super().__init__(inner)
        self.failures = failures
        self.failed = threading.Event()

    def open_write(self, path: str) -> Any:
        if path.endswith(".pack") and self.failures > 0:
            self.failures -= 1
            self.failed.set()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return super().open_write(path)


def test_a_failed_promotion_is_kept_in_the_fast_tier_and_promoted_once_the_durable_root_has_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    durable, fast = roots(tmp_path)
    full = _FullOnce(LocalBackend(durable))
    durable_backend(monkeypatch, durable, full)
    state = make_state(1)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, fast_keep_last=1) as ck:
        best = ck.save(state, tag="best", promote=True).wait()
        best_state = snapshot(state)
        assert full.failed.wait(HANG_S)
        for step in range(2, 5):  # fast retention (keep 1) would drop "best" if it were not kept
            train(state, step)
            ck.save(state).wait()
        train(state, 5)
        other = ck.save(state, promote=True).wait()  # a later promotion, which succeeds
        other_state = snapshot(state)
        ck.wait()  # "best" was tried again: nothing to raise
        durable_ids = [i.id for i in ck.list() if i.tier == "durable"]
        assert best.id in durable_ids and other.id in durable_ids
    assert same(_restored(durable, state, "best"), best_state) == []
    assert same(_restored(durable, state, other.id), other_state) == []


def test_a_promotion_that_keeps_failing_is_raised_by_wait_and_its_checkpoint_kept_until_then(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    durable, fast = roots(tmp_path)
    full = _FullOnce(LocalBackend(durable), failures=10**6)
    durable_backend(monkeypatch, durable, full)
    state = make_state(1)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, fast_keep_last=1) as ck:
        best = ck.save(state, tag="best", promote=True).wait()
        expected = snapshot(state)
        assert full.failed.wait(HANG_S)
        for step in range(2, 5):
            train(state, step)
            ck.save(state).wait()
        assert best.id in [i.id for i in ck.list()]  # kept: its failure is not raised yet
        with pytest.raises(gpusnap.StorageError, match="'best'"):
            ck.wait()  # (restore() would raise it too: it waits first)
        target = blank_state(state)
        ck.restore(target, "best")  # raised once; the checkpoint still there to fall back on
        assert same(snapshot(target), expected) == []
        full.failures = 0
    assert _manifest_ids(durable) == []


class _ExitOnce(FaultyBackend):
    """A durable root that raises SystemExit once (a BaseException, not an Exception: a
    backend's code or a plug-in calling sys.exit), on the promotion thread: at the commit's
    rename of a manifest, or at retention's removal of one after a commit."""

    def __init__(self, inner: Any, where: str) -> None:
        super().__init__(inner)
        self.where = where
        self.armed = True
        self.before_rename = self._exit_at if where == "commit" else None

    def _exit_at(self, path: str) -> None:
        if path.startswith("manifests/") and self.armed:
            self.armed = False
            raise SystemExit("a backend gave up")

    def remove(self, path: str) -> None:
        if self.where == "retention":
            self._exit_at(path)
        super().remove(path)


@pytest.mark.parametrize("where", ["commit", "retention"])
def test_a_system_exit_on_the_promotion_thread_neither_ends_it_nor_loses_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    durable, fast = roots(tmp_path)
    backend = _ExitOnce(LocalBackend(durable), where)
    durable_backend(monkeypatch, durable, backend)
    state = make_state(1)
    saved: list[tuple[str, dict[str, Any]]] = []
    outcome: dict[str, Any] = {}

    def run() -> None:  # (on a thread of its own: a hang fails the test instead of blocking the suite)
        try:
            with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, fast_keep_last=1,
                                      keep_last=1 if where == "retention" else None) as ck:
                for step in range(1, 4):
                    train(state, step)
                    saved.append((ck.save(state, promote=True).wait().id, snapshot(state)))
                ck.wait()  # (a failed promotion was tried again after a later one succeeded)
                outcome["durable"] = [i.id for i in ck.list() if i.tier == "durable"]
        except BaseException as exc:  # noqa: BLE001  (recorded for the assertions below)
            outcome["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(HANG_S)
    assert not worker.is_alive(), "wait() or close() hung: the promotion thread ended with the SystemExit"
    assert not backend.armed  # (the SystemExit was raised)
    assert "error" not in outcome, outcome.get("error")
    wanted = [cid for cid, _s in saved] if where == "commit" else [saved[-1][0]]
    assert set(wanted) <= set(outcome["durable"])
    for cid, expected in saved:
        if cid in wanted:
            assert same(_restored(durable, state, cid), expected) == []


def test_an_explicit_promote_is_never_replaced_by_a_newer_promotion(
    tmp_path: Path, durable_gate: DurableGate
) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(1)
    explicit_state: dict[str, Any] = {}
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, promote_every=5, fast_keep_last=30) as ck:
        pending = {}
        for step in range(1, 21):
            train(state, step)
            pending[step] = ck.save(state, promote=step == 7)
            if step == 7:
                explicit_state = snapshot(state)
            if step == 5:
                pending[5].wait()
                durable_gate.wait_entered()  # step 5's promotion runs, held: the others wait behind it
        infos = {step: p.wait() for step, p in pending.items()}
        durable_gate.release()
        ck.wait()
        durable_ids = {i.id for i in ck.list() if i.tier == "durable"}
    assert infos[7].id in durable_ids
    assert infos[20].id in durable_ids  # the newest cadence one replaced steps 10 and 15
    assert infos[10].id not in durable_ids and infos[15].id not in durable_ids
    assert same(_restored(durable, state, infos[7].id), explicit_state) == []


@pytest.mark.parametrize("keep", [1, 2])
def test_fast_retention_keeps_up_with_saves_that_never_wait(tmp_path: Path, keep: int) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(1, extra=400_000)
    seen = []
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, fast_keep_last=keep) as ck:
        last = None
        for step in range(2, 40):
            train(state, step)
            last = ck.save(state)
            seen.append(len(_manifest_ids(fast)))
        assert last is not None
        last.wait()
        assert len(_manifest_ids(fast)) <= keep + 1
        ck.wait()
        assert len(_manifest_ids(fast)) == keep
        cap = ck.list()[-1].stats["fast_tier_cap_bytes"]
        slabs = sum(p.stat().st_size for p in (fast / "slabs").iterdir())
    assert max(seen) <= keep + 1, seen  # within one save of the steady state at every moment
    assert slabs <= cap, (slabs, cap)


class _HeldOpening(FaultyBackend):
    """Holds a write transaction that has just taken the root's shared lock (not yet
    registered as open) until :attr:`go` is set: the moment a Checkpointer's retention after
    one commit meets the next save's transaction opening."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.holding = threading.Event()
        self.go = threading.Event()

    def lock(self, *, exclusive: bool, timeout: float) -> Any:
        got = super().lock(exclusive=exclusive, timeout=timeout)
        if not exclusive and threading.current_thread().name == "opener":
            self.holding.set()
            assert self.go.wait(HANG_S), "the test never let the transaction go on"
        return got


def test_retention_is_not_skipped_while_the_next_transaction_opens(tmp_path: Path) -> None:
    from faults import chunks_of, commit_checkpoint, small_config

    backend = _HeldOpening(LocalBackend(tmp_path / "root"))
    repo = Repository.open(tmp_path / "root", create=True, config=small_config(), backend=backend)
    repo.claim_writer()
    for seed in range(4):
        commit_checkpoint(repo, [chunks_of(seed, 2)])
    opened: list[Any] = []
    opener = threading.Thread(target=lambda: opened.append(repo.begin_write()), name="opener")
    opener.start()
    try:
        assert backend.holding.wait(HANG_S)
        report = repo.gc(1, blocking=False, fresh=False, compact=False)  # a Checkpointer's retention
    finally:
        backend.go.set()
        opener.join(HANG_S)
    opened[0].abort()
    repo.close()
    assert not report.skipped, report.notes
    assert len(report.deleted_checkpoints) == 3 and len(Repository.open(tmp_path / "root").list()) == 1


def test_two_runs_cannot_share_one_fast_root(tmp_path: Path) -> None:
    fast = tmp_path / "fast"
    state = make_state(1)
    with gpusnap.Checkpointer(tmp_path / "run-a", fast_root=fast, config=CFG) as a:
        only = a.save(state).wait()  # run A's only checkpoint, not promoted yet
    other = make_state(2)
    with gpusnap.Checkpointer(tmp_path / "run-b", fast_root=fast, config=CFG) as b:
        for use in (lambda: b.save(other), b.latest, lambda: b.restore(blank_state(other))):
            with pytest.raises(gpusnap.CheckpointError, match="belongs to the durable root"):
                use()
    assert _manifest_ids(fast) == [only.id]  # run B neither read nor deleted it
    with gpusnap.Checkpointer(tmp_path / "run-a", fast_root=fast, config=CFG) as a:
        assert a.latest().id == only.id  # type: ignore[union-attr]
