"""Wrong uses of the fast tier's arguments are clear errors, before anything is written where
it should not be: one directory for both roots, a root of the other tier, options that need a
fast_root, bad values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fast_support import CFG, cfg, roots

import gpusnap
from gpusnap.storage.repository import Repository


def _small() -> dict:
    return {"w": torch.arange(1000.0), "step": 1}


def test_the_same_directory_for_root_and_fast_root_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fast_root must be a directory of its own"):
        gpusnap.Checkpointer(tmp_path / "ck", fast_root=tmp_path / "ck", config=CFG)
    with pytest.raises(ValueError, match="fast_root must be a directory of its own"):
        gpusnap.Checkpointer(tmp_path / "ck", fast_root=tmp_path / "x" / ".." / "ck", config=CFG)


def test_a_fast_root_that_is_a_durable_root_is_refused_at_the_first_save(tmp_path: Path) -> None:
    durable, _ = roots(tmp_path)
    other = tmp_path / "other"
    with gpusnap.Checkpointer(other) as ck:
        kept = ck.save(_small()).wait().id
    with (gpusnap.Checkpointer(durable, fast_root=other, config=CFG) as ck,
          pytest.raises(gpusnap.CheckpointError, match="is a durable tier's root")):
        ck.save(_small())
    assert [m.id for m in Repository.open(other).list()] == [kept]
    assert not (other / "slabs").exists()


def test_a_root_that_is_a_fast_tier_is_refused_by_a_plain_checkpointer(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        ck.save(_small()).wait()
    with (gpusnap.Checkpointer(fast, config=CFG) as ck,
          pytest.raises(gpusnap.CheckpointError, match="is a fast tier's root")):
        ck.save(_small())


def test_a_root_that_is_a_fast_tier_is_refused_for_saves_after_it_was_listed(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        ck.save(_small()).wait()
    with gpusnap.Checkpointer(fast, config=CFG) as ck:
        assert len(ck.list()) == 1  # reading a fast root as a root is fine
        with pytest.raises(gpusnap.CheckpointError, match="is a fast tier's root"):
            ck.save(_small()).wait()


def test_a_durable_root_that_is_a_fast_tier_fails_its_promotion_clearly(tmp_path: Path) -> None:
    _, fast = roots(tmp_path)
    with gpusnap.Checkpointer(tmp_path / "first", fast_root=fast, config=CFG) as ck:
        ck.save(_small()).wait()
    ck = gpusnap.Checkpointer(fast, fast_root=tmp_path / "fast2", config=CFG)
    with pytest.raises(gpusnap.CheckpointError, match="is a fast tier's root"):
        ck.save(_small(), promote=True).wait()  # (raised by save(), wait() or the Checkpointer's wait())
        ck.wait()
    ck.close()
    assert len(Repository.open(fast).list()) == 1  # nothing was promoted into it


@pytest.mark.parametrize("kw", [{"fast_keep_last": 2}, {"promote_every": 3}])
def test_fast_options_without_a_fast_root_are_refused(tmp_path: Path, kw: dict) -> None:
    with pytest.raises(ValueError, match="need a fast_root"):
        gpusnap.Checkpointer(tmp_path / "ck", **kw)


def test_promote_true_without_a_fast_root_is_refused(tmp_path: Path) -> None:
    with gpusnap.Checkpointer(tmp_path / "ck", config=CFG) as ck:
        with pytest.raises(ValueError, match="promote=True needs a fast_root"):
            ck.save(_small(), promote=True)
        assert ck.list() == []


@pytest.mark.parametrize("kw", [{"fast_keep_last": 0}, {"promote_every": 0}, {"promote_every": True},
                                {"fast_keep_last": 1.5}])
def test_bad_fast_counts_are_refused(tmp_path: Path, kw: dict) -> None:
    with pytest.raises(ValueError, match="must be a positive integer"):
        gpusnap.Checkpointer(tmp_path / "ck", fast_root=tmp_path / "fast", **kw)


def test_a_slab_smaller_than_a_copy_piece_and_a_bad_when_busy_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fast_slab_bytes"):
        gpusnap.Checkpointer(tmp_path / "ck", fast_root=tmp_path / "fast",
                             config=cfg(fast_slab_bytes=64 * 1024, copy_piece_bytes=256 * 1024))
    with pytest.raises(ValueError, match="fast_slab_bytes"):  # one piece: a slab would have no room at all
        gpusnap.Checkpointer(tmp_path / "ck", fast_root=tmp_path / "fast",
                             config=cfg(fast_slab_bytes=256 * 1024, copy_piece_bytes=256 * 1024))
    with pytest.raises(ValueError, match="when_busy"):
        cfg(when_busy="queue")


def test_a_fast_root_that_is_not_a_local_path_is_refused(tmp_path: Path) -> None:
    with (gpusnap.Checkpointer(tmp_path / "ck", fast_root="memory://fast-tier-args", config=CFG) as ck,
          pytest.raises(ValueError, match="fast_root must be a local path")):
        ck.save(_small())
