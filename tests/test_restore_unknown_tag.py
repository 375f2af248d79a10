"""Restoring a tag that is not there says which tags are there, and, when this process's
retention deleted it, says so (the README's keep_last example met exactly this)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gpusnap


def _state() -> dict[str, object]:
    return {"w": torch.zeros(8), "step": 0}


def test_a_tag_retention_deleted_is_named_as_such_with_the_tags_kept(tmp_path: Path) -> None:
    state = _state()
    with gpusnap.Checkpointer(tmp_path / "ck", keep_last=3) as ckpt:
        for step in range(0, 600, 100):
            state["step"] = step
            ckpt.save(state, tag=f"step-{step}")
        ckpt.wait()
        with pytest.raises(gpusnap.CheckpointNotFoundError) as info:
            ckpt.restore(state, "step-100")
    message = str(info.value)
    assert "'step-100'" in message and "retention deleted it (keep_last=3" in message
    assert "tags: step-300, step-400, step-500" in message


def test_another_process_lists_the_tags_and_claims_nothing(tmp_path: Path) -> None:
    with gpusnap.Checkpointer(tmp_path / "ck", keep_last=2) as ckpt:
        for tag in ("a", "b", "c"):
            ckpt.save(_state(), tag=tag, blocking=True)
    with gpusnap.Checkpointer(tmp_path / "ck", keep_last=2) as later:  # (as a restarted job makes it)
        with pytest.raises(gpusnap.CheckpointNotFoundError) as info:
            later.restore(_state(), "a")
        later.restore(_state(), "b").wait()  # (a tag that is there restores)
    message = str(info.value)
    assert "tags: b, c" in message and "retention" not in message


def test_the_tags_of_both_tiers_are_listed(tmp_path: Path) -> None:
    with gpusnap.Checkpointer(tmp_path / "ck", fast_root=tmp_path / "fast", promote_every=100) as ckpt:
        ckpt.save(_state(), tag="promoted", promote=True, blocking=True)
        ckpt.save(_state(), tag="fast-only", blocking=True)
        ckpt.wait()
        with pytest.raises(gpusnap.CheckpointNotFoundError) as info:
            ckpt.restore(_state(), "nope")
    assert "fast-only" in str(info.value) and "promoted" in str(info.value)
