"""The fast tier's space: slabs reused (bounded memory), unchanged chunks named again (not
copied), and a tier too small for a save (``when_busy`` "wait" and "skip"), then room again."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from fast_support import (
    CFG,
    HANG_S,
    blank_state,
    cfg,
    make_state,
    roots,
    same,
    snapshot,
    train,
)

import gpusnap
from gpusnap.cli.main import main as cli_main
from gpusnap.storage import fast_tier
from gpusnap.storage.repository import Repository


def _slabs(fast: Path) -> list[tuple[str, int]]:
    return sorted((p.name, p.stat().st_size) for p in (fast / "slabs").iterdir())


def test_twenty_saves_of_a_changing_model_reuse_the_same_slabs(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(0, width=128, extra=200_000)  # ~1.3 MB a save
    seen = []
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        for step in range(1, 21):
            train(state, step)
            info = ck.save(state).wait()
            assert info.stats["bytes_written"] == info.nbytes  # all of it changed: nothing reused
            seen.append(_slabs(fast))
        expected = snapshot(state)
        target = blank_state(state)
        ck.restore(target)
    warm = seen[3]  # two kept, one being written: three saves' worth, then reuse
    assert all(s == warm for s in seen[3:]), seen
    assert sum(n for _, n in warm) <= 3 * (2 << 20)
    assert same(snapshot(target), expected) == []
    assert Repository.open(fast).verify().ok


def _frozen(seed: int) -> dict[str, Any]:
    state = make_state(seed, width=128, extra=200_000)
    return {"model": state["model"], "x": state["x"], "step": 0}


def test_a_save_of_unchanged_weights_writes_almost_nothing_and_restores_bit_exactly(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = _frozen(1)
    expected = snapshot(state)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        first = ck.save(state).wait()
        infos = []
        for step in range(1, 6):  # retention deletes older manifests: their shared bytes stay in use
            state["step"] = step
            infos.append(ck.save(state).wait())
        expected["step"] = 5
        assert first.stats["bytes_written"] == first.nbytes
        for info in infos:
            assert info.stats["bytes_written"] <= first.nbytes // 20, info.stats
            assert info.stats["bytes_skipped"] >= first.nbytes * 19 // 20, info.stats
        with torch.no_grad():
            for p in state["model"].parameters():
                p.zero_()
        state["x"].zero_()
        ck.restore(state)
    assert same(snapshot(state), expected) == []
    assert Repository.open(fast).verify().ok


_BIG = 375_000  # 1.5 MB: one fits a 2 MiB slab, a 4 MiB tier holds two


def _big(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"x": torch.randn(_BIG), "step": seed}


def _durable_before(durable: Path, fast: Path) -> str:
    """A durable root holding one promoted checkpoint; returns its id."""
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        cid = ck.save({"w": torch.arange(1000.0), "step": 0}, promote=True).wait().id
    return cid


def test_a_save_larger_than_the_fast_tier_fails_clearly_and_harms_no_root(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    kept = _durable_before(durable, fast)
    before = Repository.open(fast).list()
    with gpusnap.Checkpointer(durable, fast_root=fast, config=cfg(fast_tier_bytes=4 << 20)) as ck:
        raised_by_save = False
        with pytest.raises(gpusnap.StorageError, match=f"the fast tier {fast} has no room") as err:
            try:
                pending = ck.save({"x": torch.randn(3 * _BIG), "step": 1})  # 4.5 MB > 4 MiB
            except gpusnap.StorageError:
                raised_by_save = True
                raise
            pending.wait()
        assert raised_by_save, "expected from save() itself: no room is known before any byte moves"
        assert "Config.fast_tier_bytes" in str(err.value)
        assert [i.id for i in ck.list()] == [kept]
    assert [m.id for m in Repository.open(fast).list()] == [m.id for m in before]
    assert Repository.open(durable).verify().ok and Repository.open(fast).verify().ok


def test_with_when_busy_skip_a_save_without_room_is_skipped_and_close_does_not_raise(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    kept = _durable_before(durable, fast)
    ck = gpusnap.Checkpointer(durable, fast_root=fast, config=cfg(fast_tier_bytes=4 << 20, when_busy="skip"))
    pending = ck.save({"x": torch.randn(3 * _BIG), "step": 1})
    with pytest.raises(gpusnap.SaveSkipped, match="fast tier has no room"):
        pending.wait()
    ck.wait()  # a skip is reported by its own handle only
    ck.close()
    assert [m.id for m in Repository.open(durable).list()] == [kept]


def test_a_full_fast_tier_saves_again_once_checkpoints_are_deleted_or_it_may_grow(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    small = cfg(fast_tier_bytes=4 << 20)
    state = _big(1)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=small) as ck:  # fast_keep_last=2
        ck.save(state).wait()
        state["x"].add_(1)
        second = ck.save(state).wait().id
        state["x"].add_(1)
        with pytest.raises(gpusnap.StorageError, match="beside the 2 checkpoint"):
            ck.save(state).wait()  # the two it keeps fill it: a third needs room until retention
    assert cli_main(["gc", str(fast), "--keep-last", "1"]) == 0  # room for one more again
    with gpusnap.Checkpointer(durable, fast_root=fast, config=small) as ck:
        third = ck.save(state).wait()
        assert third.tier == "fast"
        assert [i.id for i in ck.list()] == [second, third.id]
        expected = snapshot(state)
        state["x"].add_(1)
        with pytest.raises(gpusnap.StorageError, match="no room"):
            ck.save(state).wait()
    with gpusnap.Checkpointer(durable, fast_root=fast, config=cfg(fast_tier_bytes=8 << 20)) as ck:
        fourth = ck.save(state).wait()  # a bigger tier: one more slab
        target = {"x": torch.zeros(_BIG), "step": -1}
        ck.restore(target, third.id)
        assert same(snapshot(target), expected) == []
        assert ck.latest().id == fourth.id  # type: ignore[union-attr]
    assert Repository.open(fast).verify().ok


def test_with_when_busy_skip_a_save_while_the_previous_one_copies_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    durable, fast = roots(tmp_path)
    copying, go_on = threading.Event(), threading.Event()
    take = fast_tier.FastTxn.take

    def held_take(self: Any, n: int) -> Any:  # the copier waits before its first region
        copying.set()
        assert go_on.wait(HANG_S), "never released"
        return take(self, n)

    monkeypatch.setattr(fast_tier.FastTxn, "take", held_take)
    state = make_state(1)
    expected = snapshot(state)
    ck = gpusnap.Checkpointer(durable, fast_root=fast, config=cfg(when_busy="skip"))
    try:
        first = ck.save(state)
        assert copying.wait(HANG_S)
        train(state, 2)
        skipped = ck.save(state)  # returns at once: the fast tier is busy with the first
        with pytest.raises(gpusnap.SaveSkipped, match="previous save is still copying"):
            skipped.wait()
    finally:
        go_on.set()
    info = first.wait()
    ck.close()  # the skip is not raised again
    assert [i.id for i in Repository.open(fast).list()] == [info.id]
    target = blank_state(state)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as again:
        again.restore(target)
    assert same(snapshot(target), expected) == []


def test_with_when_busy_wait_a_save_waits_for_the_promotion_that_holds_the_room_then_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fast_support import hold_durable_writes

    gates = hold_durable_writes(monkeypatch)
    gate = next(gates)
    refused = threading.Event()
    reserve = fast_tier.FastTxn.reserve

    def watched(self: Any, nbytes: int, piece: int) -> bool:
        ok = reserve(self, nbytes, piece)
        if not ok:
            refused.set()
        return ok

    monkeypatch.setattr(fast_tier.FastTxn, "reserve", watched)
    durable, fast = roots(tmp_path)
    state = _big(1)
    # a 4 MiB tier holds two saves; fast_keep_last=1, but the promoted one is pinned meanwhile
    ck = gpusnap.Checkpointer(durable, fast_root=fast, fast_keep_last=1, config=cfg(fast_tier_bytes=4 << 20))
    try:
        first = ck.save(state, promote=True).wait()
        gate.wait_entered()  # its promotion holds it in the tier
        state["x"].add_(1)
        ck.save(state).wait()
        state["x"].add_(1)
        expected = snapshot(state)
        outcome: list[Any] = []
        saver = threading.Thread(target=lambda: outcome.append(ck.save(state).wait()))
        saver.start()
        assert refused.wait(HANG_S), "the third save found room at once"
        assert outcome == []  # it waits (when_busy="wait"): the promotion in flight may make room
        gate.release()  # the promotion ends; retention drops the first save; the third commits
        saver.join(HANG_S)
        assert not saver.is_alive() and len(outcome) == 1 and outcome[0].tier == "fast"
        target = {"x": torch.zeros(_BIG), "step": -1}
        ck.restore(target, outcome[0].id)
        assert same(snapshot(target), expected) == []
        assert first.id in [i.id for i in ck.list() if i.tier == "durable"]
    finally:
        gate.release()
        ck.close()
        next(gates, None)
    assert Repository.open(fast).verify().ok and Repository.open(durable).verify().ok
