"""Saving to a fast tier and reading back: bit-exact round trips, ``info.tier``, and
``list()``/``latest()``/``restore()`` across the fast and the durable tier."""

from __future__ import annotations

from pathlib import Path

from fast_support import CFG, blank_state, make_state, roots, same, snapshot, train

import gpusnap


def _restored(ck: gpusnap.Checkpointer, like: dict, checkpoint: str | None) -> dict:
    target = blank_state(like)
    ck.restore(target, checkpoint)
    return snapshot(target)


def _manifest_ids(root: Path) -> set[str]:
    return {p.stem for p in (root / "manifests").glob("*.json")}


def test_a_fast_save_round_trips_model_optimizer_and_values_bit_exactly(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(1)
    expected = snapshot(state)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        info = ck.save(state).wait()
        train(state, 2)  # the program goes on: the checkpoint keeps the values at save()
        assert info.tier == "fast"
        assert info.stats["bytes_total"] == info.nbytes > 0
        assert same(_restored(ck, state, info.id), expected) == []
    assert _manifest_ids(fast) == {info.id}
    assert not durable.exists()  # nothing was promoted: the durable root is not even made


def test_list_and_latest_span_both_tiers_and_a_promoted_checkpoint_lists_once_as_durable(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(1)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, fast_keep_last=5) as ck:
        a = ck.save(state).wait()
        train(state, 2)
        b = ck.save(state, promote=True).wait()
        train(state, 3)
        c = ck.save(state).wait()
        ck.wait()  # the promotion of b
        assert [a.tier, b.tier, c.tier] == ["fast", "fast", "fast"]  # as committed, before promotion
        listed = ck.list()
        assert [(i.id, i.tier) for i in listed] == [(a.id, "fast"), (b.id, "durable"), (c.id, "fast")]
        latest = ck.latest()
        assert latest is not None and (latest.id, latest.tier) == (c.id, "fast")
    assert _manifest_ids(fast) == {a.id, b.id, c.id}  # b is in both roots
    assert _manifest_ids(durable) == {b.id}


def test_restore_of_the_latest_takes_the_newest_fast_checkpoint_over_an_older_durable_one(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(1)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, fast_keep_last=1) as ck:
        ck.save(state, promote=True).wait()
        ck.wait()
        train(state, 2)
        newest = ck.save(state).wait()  # fast only; retention drops the promoted one from the fast tier
        expected = snapshot(state)
        train(state, 3)
        assert same(_restored(ck, state, None), expected) == []
        assert ck.latest().id == newest.id  # type: ignore[union-attr]


def test_restore_of_the_latest_takes_a_durable_checkpoint_newer_than_the_fast_ones(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(1)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        old = ck.save(state).wait()
    train(state, 2)
    with gpusnap.Checkpointer(durable, config=CFG) as ck:  # another run writes the durable root only
        newer = ck.save(state).wait()
    expected = snapshot(state)
    train(state, 3)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        assert [(i.id, i.tier) for i in ck.list()] == [(old.id, "fast"), (newer.id, "durable")]
        assert same(_restored(ck, state, None), expected) == []


def test_restore_by_id_and_by_tag_of_a_fast_only_and_of_a_durable_only_checkpoint(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(1)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, fast_keep_last=1) as ck:
        first = ck.save(state, tag="first", promote=True).wait()
        ck.wait()
        first_values = snapshot(state)
        train(state, 2)
        second = ck.save(state, tag="second").wait()
        second_values = snapshot(state)
        train(state, 3)
        assert _manifest_ids(fast) == {second.id} and _manifest_ids(durable) == {first.id}
        for ref in (first.id, "first"):  # durable only
            assert same(_restored(ck, state, ref), first_values) == [], ref
        for ref in (second.id, "second"):  # fast only
            assert same(_restored(ck, state, ref), second_values) == [], ref
