"""Checkpointer.delete: one checkpoint goes, its unshared data with it; the others stay whole."""

from __future__ import annotations

import os

import pytest
import torch

import gpusnap


def _bytes_under(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def test_delete_by_tag_and_id_keeps_the_others(tmp_path):
    root = str(tmp_path / "ckpt")
    w = torch.zeros(64, 1024)
    app = {"w": w, "step": 0}
    with gpusnap.Checkpointer(root) as ckpt:
        ids = []
        for step in range(3):
            w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(step)))  # no chunk shared
            app["step"] = step
            ids.append(ckpt.save(app, tag=f"s{step}").wait().id)
        before = _bytes_under(root)
        ckpt.delete("s1")
        ckpt.delete(ids[0])
        assert [i.tag for i in ckpt.list()] == ["s2"]
        assert _bytes_under(root) <= before - 2 * w.nbytes  # the deleted ones' chunks are freed
        expected = w.clone()
        w.zero_()
        ckpt.restore(app, "s2")
        assert app["step"] == 2 and torch.equal(w, expected)
        with pytest.raises(gpusnap.CheckpointNotFoundError):
            ckpt.delete("s1")


def test_a_save_after_deleting_the_latest_stores_its_bytes_again(tmp_path):
    root = str(tmp_path / "ckpt")
    w = torch.arange(64 * 1024, dtype=torch.float32)
    app = {"w": w}
    with gpusnap.Checkpointer(root) as ckpt:
        first = ckpt.save(app).wait().id
        ckpt.delete(first)  # the next save would skip these unchanged chunks: they are gone
        second = ckpt.save(app).wait().id
        w.zero_()
        ckpt.restore(app, second)
    assert torch.equal(w, torch.arange(64 * 1024, dtype=torch.float32))
    assert gpusnap.load(root)["w"].equal(w)


def test_delete_refuses_bad_input(tmp_path):
    with gpusnap.Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        with pytest.raises(ValueError):
            ckpt.delete("")
        with pytest.raises(gpusnap.CheckpointNotFoundError):
            ckpt.delete("nothing-here")


def test_delete_is_refused_on_a_collective_checkpointer(tmp_path) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with gpusnap.Checkpointer(tmp_path / "ck") as ck:
            info = ck.save({"w": torch.ones(4)}).wait()
            with pytest.raises(gpusnap.CheckpointError, match="not yet collective"):
                ck.delete(info.id)
            assert [i.id for i in ck.list()] == [info.id]
    finally:
        dist.destroy_process_group()
