"""Promotion from the fast tier to the durable root: which saves are promoted, waiting for
them, retention per tier, and a promotion held mid-way while saves and retention go on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fast_support import (
    CFG,
    DurableGate,
    blank_state,
    hold_durable_writes,
    make_state,
    roots,
    same,
    snapshot,
    train,
)

import gpusnap
from gpusnap.storage.repository import Repository


@pytest.fixture
def durable_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[DurableGate]:
    """Promotions held in the durable store until the test releases them."""
    yield from hold_durable_writes(monkeypatch)


def _manifest_ids(root: Path) -> list[str]:
    return sorted(p.stem for p in (root / "manifests").glob("*.json")) if root.exists() else []


def _restored_plain(root: Path, like: dict, checkpoint: str) -> dict:
    """Restored by a Checkpointer that knows nothing of the fast tier."""
    target = blank_state(like)
    with gpusnap.Checkpointer(root) as ck:
        ck.restore(target, checkpoint)
    return snapshot(target)


def test_promote_every_n_promotes_every_nth_committed_save(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(0)
    infos = []
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, promote_every=3, fast_keep_last=10) as ck:
        for step in range(1, 8):
            train(state, step)
            infos.append(ck.save(state).wait())
            ck.wait()  # (the promotion, if any, before the next save: no promotion is superseded)
    promoted = [i.id for n, i in enumerate(infos, 1) if n % 3 == 0]
    assert _manifest_ids(durable) == sorted(promoted)
    assert [i.stats.get("promotion") for i in infos] == [None, None, "queued", None, None, "queued", None]
    assert _manifest_ids(fast) == sorted(i.id for i in infos)  # promotion copies, never moves


def test_save_with_promote_true_is_promoted_whatever_the_count(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(1)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, promote_every=100) as ck:
        ck.save(state).wait()
        train(state, 2)
        chosen = ck.save(state, promote=True).wait()
        ck.wait()
        tiers = {i.id: i.tier for i in ck.list()}
    assert _manifest_ids(durable) == [chosen.id]
    assert tiers[chosen.id] == "durable"


def test_checkpointer_wait_waits_for_the_promotion(tmp_path: Path, durable_gate: DurableGate) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(1)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        info = ck.save(state, promote=True).wait()  # committed to the fast tier: promotion is apart
        durable_gate.wait_entered()
        with pytest.raises(TimeoutError, match="promotion"):
            ck.wait(timeout=0.2)  # the gate is closed: however long, it cannot have finished
        assert _manifest_ids(durable) == []
        durable_gate.release()
        ck.wait()
        assert _manifest_ids(durable) == [info.id]


def test_a_promoted_checkpoint_restores_bit_exactly_without_the_fast_root(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(1)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        info = ck.save(state, tag="keep", promote=True).wait()
        expected = snapshot(state)
        train(state, 2)
    # close() finished the promotion; the durable copy is an ordinary checkpoint of its root
    assert same(_restored_plain(durable, state, info.id), expected) == []
    assert same(_restored_plain(durable, state, "keep"), expected) == []
    report = Repository.open(durable).verify()
    assert report.ok and report.checked_checkpoints == 1, report
    promoted = Repository.open(durable).load_manifest(info.id)
    assert promoted.stats["promoted_from"] == "fast" and promoted.tag == "keep"
    assert promoted.stats["promotion_s"] >= 0 and promoted.stats["promotion_cpu_s"] >= 0  # (reported apart from the save's)


def test_keep_last_and_fast_keep_last_apply_per_tier(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(0)
    ids = []
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, keep_last=2, promote_every=1) as ck:
        for step in range(1, 6):
            train(state, step)
            ids.append(ck.save(state).wait().id)
            ck.wait()
        listed = [(i.id, i.tier) for i in ck.list()]
    assert _manifest_ids(durable) == sorted(ids[-2:])  # keep_last=2
    assert _manifest_ids(fast) == sorted(ids[-2:])  # fast_keep_last: 2 by default
    assert listed == [(ids[-2], "durable"), (ids[-1], "durable")]


def test_fast_keep_last_keeps_more_fast_checkpoints_than_the_durable_root(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(0)
    ids = []
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, keep_last=1, fast_keep_last=3,
                              promote_every=2) as ck:
        for step in range(1, 7):
            train(state, step)
            ids.append(ck.save(state).wait().id)
            ck.wait()
        listed = [(i.id, i.tier) for i in ck.list()]
    assert _manifest_ids(fast) == sorted(ids[-3:])
    assert _manifest_ids(durable) == [ids[5]]  # promoted: saves 2, 4, 6; keep_last=1
    assert listed == [(ids[3], "fast"), (ids[4], "fast"), (ids[5], "durable")]


def test_a_held_promotion_keeps_its_checkpoint_through_saves_and_retention(
    tmp_path: Path, durable_gate: DurableGate
) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(1)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, fast_keep_last=1) as ck:
        held = ck.save(state, promote=True).wait()
        expected = snapshot(state)
        durable_gate.wait_entered()  # the promotion has begun storing chunks, and waits
        later = []
        for step in range(2, 7):  # every save reuses free slab bytes; retention runs after each
            train(state, step)
            later.append(ck.save(state).wait().id)
            assert held.id in _manifest_ids(fast), f"retention deleted the checkpoint being promoted (step {step})"
        assert _manifest_ids(fast) == sorted([held.id, later[-1]])
        assert _manifest_ids(durable) == []
        durable_gate.release()
        ck.wait()
        assert _manifest_ids(durable) == [held.id]
        train(state, 7)
        last = ck.save(state).wait().id  # unpinned now: the next retention drops it from the fast tier
        assert _manifest_ids(fast) == [last]
    assert same(_restored_plain(durable, state, held.id), expected) == []
    assert Repository.open(durable).verify().ok
    assert Repository.open(fast).verify().ok
