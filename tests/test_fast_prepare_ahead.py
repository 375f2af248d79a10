"""A Checkpointer with a fast root prepares the slabs of later saves in the background
(``FastTier.prepare_for`` when a save reserves room, ``save/fast_room.py``): after the first save the
tier holds slab bytes for ``fast_keep_last + 1`` saves, the saves that follow create no
slab file, and a slab the preparer could not make is left to the save that takes it.

CPU tensors (as every fast-tier test): the slabs are files under ``tmp_path``. Nothing
waits on time: the tests join the tier's preparer (``FastTier.wait_prepared``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fast_support import CFG, blank_state, make_state, roots, same, snapshot, train

import gpusnap
from gpusnap.storage.fast_tier import FastTier
from gpusnap.storage.repository import Repository


def _slabs(fast: Path) -> list[tuple[str, int]]:
    return sorted((p.name, p.stat().st_size) for p in (fast / "slabs").iterdir())


def _restored(ck: gpusnap.Checkpointer, like: dict[str, Any], checkpoint: str) -> dict[str, Any]:
    target = blank_state(like)
    ck.restore(target, checkpoint)
    return snapshot(target)


@pytest.mark.parametrize(
    ("extra", "keep"),
    [(200_000, 2), (600_000, 1), (600_000, 3)],  # ~1.4 MB a save (under one 2 MiB slab); ~3 MB (two slabs)
)
def test_after_the_first_save_later_saves_find_their_slabs_ready(tmp_path: Path, extra: int, keep: int) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(0, width=128, extra=extra)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, fast_keep_last=keep) as ck:
        first = ck.save(state).wait()
        assert first.tier == "fast"
        tier = ck._tiers.fast()
        assert tier is not None
        tier._preparer.join()
        assert not tier._preparer.busy()
        assert tier._preparer.errors == []
        ready = _slabs(fast)
        held = sum(n for _, n in ready)
        assert held >= (keep + 1) * first.nbytes, (ready, first.nbytes)  # the kept ones and the next
        assert held <= tier.capacity()
        assert tier.prepared_bytes() == held  # every slab file is mapped already
        assert not tier.unprepared(list(range(len(ready))))
        infos = [first]
        expected = {first.id: snapshot(state)}
        for step in (1, 2):
            train(state, step)
            info = ck.save(state).wait()
            assert info.tier == "fast"
            assert _slabs(fast) == ready, f"save {step + 1} made slab files"
            assert info.stats["fast_prepared_bytes"] == held
            assert info.stats["fast_prepare_errors"] == []
            assert info.stats["bytes_written"] == info.nbytes  # all of it changed
            infos.append(info)
            expected[info.id] = snapshot(state)
        assert "fast_prepared_bytes" in first.stats and first.stats["fast_prepare_errors"] == []
        train(state, 3)
        retained = {i.id for i in ck.list() if i.tier == "fast"}
        for info in infos:
            if info.id in retained:
                assert same(_restored(ck, state, info.id), expected[info.id]) == [], info.id
        assert {i.id for i in infos[-keep:]} <= retained  # (each checked bit-exactly above)
    assert Repository.open(fast).verify().ok


def test_closing_the_checkpointer_stops_the_preparer(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(0, width=128, extra=200_000)
    ck = gpusnap.Checkpointer(durable, fast_root=fast, config=CFG)
    try:
        ck.save(state).wait()
        tier = ck._tiers.fast()
        assert tier is not None
        tier._preparer.join()
        before = _slabs(fast)
    finally:
        ck.close()
    assert tier._preparer._stopped
    tier.prepare_ahead(4 * sum(n for _, n in before))  # asked for more after close: nothing starts
    assert not tier._preparer.busy()
    tier._preparer.join()
    assert _slabs(fast) == before


REFUSED = 1  # the first slab the first save's prepare_ahead adds beside its own


def test_a_slab_the_preparer_could_not_make_is_made_by_the_save_that_takes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = FastTier.make_slab
    refused: list[int] = []

    def refuse_one_in_the_background(self: FastTier, slab: int) -> Any:
        import threading

        # one fixed slab that prepare_ahead sets aside after the first save (never the first
        # save's own slab 0), refused whenever the background thread tries it
        if threading.current_thread().name == "gpusnap-slab-prep" and slab == REFUSED:
            refused.append(slab)
            raise OSError(28, "No space left on device")
        return real(self, slab)

    monkeypatch.setattr(FastTier, "make_slab", refuse_one_in_the_background)
    durable, fast = roots(tmp_path)
    state = make_state(0, width=128, extra=200_000)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        ck.save(state).wait()  # the save never sees the preparer's error
        tier = ck._tiers.fast()
        assert tier is not None
        tier._preparer.join()
        assert len(refused) == 1
        bad = refused[0]
        assert len(tier._preparer.errors) == 1 and tier._preparer.errors[0].startswith(f"slab {bad}: ")
        assert tier.unprepared([bad])
        took = None
        for step in range(1, 5):  # saves rotate through the slabs: one takes the refused slab
            train(state, step)
            info = ck.save(state).wait()
            # (each save wants the unprepared slab again: the preparer may retry it meanwhile)
            # (the preparer retries it meanwhile: refused again, or a no-op once a save made it)
            seen = info.stats["fast_prepare_errors"]
            assert all(e.startswith(f"slab {bad}: ") for e in seen)
            expected = snapshot(state)
            assert same(_restored(ck, state, info.id), expected) == []
            if not tier.unprepared([bad]):
                took = step
                break
        assert took is not None, "no save took the slab the preparer could not make"
        # every background try was refused: the save made the slab itself (on its copier)
        tier._preparer.join()
        assert set(refused) == {bad}
        assert all(e.startswith(f"slab {bad}: ") for e in tier._preparer.errors)
        assert len(tier._preparer.errors) <= 1  # one line per slab, however often it was refused
        # (none once a retry found the slab ready: the save made it)
    assert Repository.open(fast).verify().ok


def test_prepare_makes_the_first_saves_slabs_before_it(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(0, width=128, extra=200_000)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, fast_keep_last=2) as ck:
        made = ck.prepare(state, wait=True)
        ready = _slabs(fast)
        assert made == sum(n for _, n in ready) > 0
        assert ck._tiers.fast().prepared_bytes() == made
        first = ck.save(state).wait()
        assert made >= 3 * first.nbytes  # the two kept and the next
        assert _slabs(fast) == ready, "the first save made slab files"
        target = _restored(ck, state, first.id)
    assert same(target, snapshot(state)) == []


def test_prepare_by_bytes_and_its_bad_input(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, fast_keep_last=1) as ck:
        with pytest.raises(ValueError, match="app_state or nbytes"):
            ck.prepare()
        with pytest.raises(ValueError, match="app_state or nbytes"):
            ck.prepare({}, nbytes=1)
        with pytest.raises(ValueError, match="nbytes must be"):
            ck.prepare(nbytes=-1)
        assert ck.prepare(nbytes=1 << 20, wait=True) >= 2 << 20
    with pytest.raises(gpusnap.CheckpointError):
        ck.prepare(nbytes=1)  # closed


def test_prepare_without_a_fast_tier_on_cpu_sets_nothing_aside(tmp_path: Path) -> None:
    with gpusnap.Checkpointer(tmp_path / "d", config=CFG) as ck:
        assert ck.prepare(make_state(0, width=32), wait=True) == 0
