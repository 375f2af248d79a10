"""Faults around the fast tier: its file system full (a real tmpfs), its directory removed
between saves, and a durable root that fails while checkpoints are promoted to it."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
from fast_support import (
    CFG,
    blank_state,
    durable_backend,
    make_state,
    roots,
    run_on_small_tmpfs,
    same,
    snapshot,
    train,
)
from faults import FaultyBackend

import gpusnap
from gpusnap.storage.backend import LocalBackend
from gpusnap.storage.repository import Repository

FULL_TMPFS = textwrap.dedent(
    """
    import glob, json, os, subprocess, sys, torch, gpusnap
    from gpusnap.storage import slab_prep
    from gpusnap.storage.repository import Repository
    slab_prep.STEP_BYTES = 256 * 1024  # a slab is allocated in steps: those made before ENOSPC go back
    mount, durable = sys.argv[1], sys.argv[2]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mount], check=True)
    ballast = os.path.join(mount, "ballast")
    with open(ballast, "wb") as f:
        f.write(b"\\1" * (3 << 20))  # 1 MiB left: less than a 2 MiB slab
    fast = os.path.join(mount, "fast")
    # a tier allowed more than the tmpfs holds: its slab's allocation meets ENOSPC itself
    cfg = gpusnap.Config(chunk_size=64 * 1024, copy_piece_bytes=256 * 1024, fast_slab_bytes=2 << 20,
                         fast_tier_bytes=64 << 20)
    out = {}
    state = {"w": torch.arange(250_000, dtype=torch.float32), "step": 1}  # 1 MB
    with gpusnap.Checkpointer(durable, fast_root=fast, config=cfg) as ck:
        try:
            ck.save(state).wait()
            out["error"] = None
        except gpusnap.StorageError as exc:
            out["error"] = str(exc)
        out["slab_blocks"] = sum(os.stat(p).st_blocks for p in glob.glob(os.path.join(fast, "**", "*.slab"), recursive=True))
        out["listed"] = [i.id for i in ck.list()]
        os.remove(ballast)  # space is back
        state["step"] = 2
        out["again"] = ck.save(state).wait().id
    target = {"w": torch.zeros(250_000), "step": 0}
    with gpusnap.Checkpointer(durable, fast_root=fast, config=cfg) as ck:
        ck.restore(target)
    out["restored"] = bool(torch.equal(target["w"], torch.arange(250_000, dtype=torch.float32)))
    out["step"] = target["step"]
    out["verify"] = Repository.open(fast).verify().ok
    print(json.dumps(out))
    """
)


def test_a_full_tmpfs_under_the_fast_tier_fails_the_save_clearly_and_the_next_one_works(tmp_path: Path) -> None:
    run = run_on_small_tmpfs(tmp_path, FULL_TMPFS, str(tmp_path / "durable"))
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["error"] is not None and "No space left on device" in out["error"], out
    assert "slab" in out["error"], out  # it says what it was doing: creating a slab of the fast tier
    assert out["slab_blocks"] == 0, out  # the failed slab keeps none of the memory its first steps took
    assert out["listed"] == [], out
    assert out["again"] and out["restored"] and out["step"] == 2 and out["verify"], out


def test_a_fast_root_removed_between_saves_is_made_again_and_the_durable_root_is_untouched(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(1)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        promoted = ck.save(state, promote=True).wait()
        ck.wait()
        durable_files = sorted(p.relative_to(durable) for p in durable.rglob("*") if p.is_file())
        old_tier = ck._tiers.fast()
        assert old_tier is not None
        old_tier._preparer.join()
        shutil.rmtree(fast)  # a cleaned /dev/shm
        train(state, 2)
        after = ck.save(state).wait()
        expected = snapshot(state)
        assert after.tier == "fast"
        # the old tier let its maps go (their deleted files' memory with them) and is forgotten
        assert ck._tiers.fast() is not old_tier and old_tier._maps == {} and old_tier not in ck._tiers.opened
        assert [(i.id, i.tier) for i in ck.list()] == [(promoted.id, "durable"), (after.id, "fast")]
        train(state, 3)
        again = ck.save(state).wait()  # and the one after (its previous checkpoint is in the new tier)
        target = blank_state(state)
        ck.restore(target, after.id)
        assert same(snapshot(target), expected) == []
        assert ck.latest().id == again.id  # type: ignore[union-attr]
    assert sorted(p.relative_to(durable) for p in durable.rglob("*") if p.is_file()) == durable_files
    assert Repository.open(durable).verify().ok
    assert Repository.open(fast).verify().ok


def _faulty_durable(monkeypatch: pytest.MonkeyPatch, durable: Path) -> FaultyBackend:
    """The durable root's backend, through which the test fails its writes."""
    return durable_backend(monkeypatch, durable, FaultyBackend(LocalBackend(durable)))


def test_a_failing_durable_root_fails_promotion_once_while_fast_saves_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    durable, fast = roots(tmp_path)
    faulty = _faulty_durable(monkeypatch, durable)
    state = make_state(1)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        first = ck.save(state, promote=True).wait()
        ck.wait()
        faulty.fail_open_write = lambda path: True  # the durable root goes away: nothing can be written
        faulty.fail_rename = lambda path: True
        train(state, 2)
        lost = ck.save(state, promote=True).wait()  # committed to the fast tier all the same
        fast_ids = [lost.id]
        for step in (3, 4):
            train(state, step)
            fast_ids.append(ck.save(state).wait().id)
        with pytest.raises(gpusnap.StorageError, match="promoting to the durable root") as err:
            ck.wait()
        assert "No space left on device" in str(err.value), err.value  # the cause, named
        ck.wait()  # raised once
        assert [m.id for m in Repository.open(durable).list()] == [first.id]
        faulty.fail_open_write = faulty.fail_rename = None  # the fault clears
        train(state, 5)
        later = ck.save(state, promote=True).wait()
        expected = snapshot(state)
        ck.wait()  # this promotion succeeds
        tiers = {i.id: i.tier for i in ck.list()}
    assert tiers[later.id] == "durable" and tiers[fast_ids[-1]] == "fast"
    monkeypatch.undo()
    assert [m.id for m in Repository.open(durable).list()] == [first.id, later.id]
    target = blank_state(state)
    with gpusnap.Checkpointer(durable) as plain:
        plain.restore(target, later.id)
    assert same(snapshot(target), expected) == []
    assert Repository.open(durable).verify().ok and Repository.open(fast).verify().ok


def test_a_promotion_failure_not_waited_for_is_raised_by_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    durable, fast = roots(tmp_path)
    faulty = _faulty_durable(monkeypatch, durable)
    faulty.fail_open_write = lambda path: True  # the durable root cannot even be made
    ck = gpusnap.Checkpointer(durable, fast_root=fast, config=CFG)
    info = ck.save({"w": torch.arange(10_000.0), "step": 1}, promote=True).wait()
    with pytest.raises(gpusnap.StorageError, match="promoting to the durable root"):
        ck.close()
    ck.close()  # once
    monkeypatch.undo()
    assert [m.id for m in Repository.open(fast).list()] == [info.id]  # the checkpoint stays in the fast tier
