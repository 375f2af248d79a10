"""DTensors in one process (a gloo group of one rank, torn down after each test): their
nodes across planned flattens, and a collective Checkpointer of world size 1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import gpusnap
from gpusnap.state.flatten import flatten


@pytest.fixture
def mesh() -> Iterator[object]:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _dtensor(mesh: object, values: torch.Tensor) -> object:
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(values, mesh, [Shard(0)], run_check=False)


def test_a_replanned_flatten_gives_the_dtensor_its_new_leaf(mesh: object) -> None:
    a = _dtensor(mesh, torch.arange(4.0))
    first = flatten({"a": a, "c": torch.zeros(2)})
    again = flatten({"a": a, "c": torch.zeros(3)}, plan=first.plan)  # c laid out otherwise: worked out anew
    node = again.tree["items"][0][1]
    assert node["t"] == "dtensor" and node["placements"] == ["S(0)"] and node["shape"] == (4,)
    assert node["local"] is not first.tree["items"][0][1]["local"]  # (the plan's nodes are never changed)
    assert node["local"] == flatten({"a": a, "c": torch.zeros(3)}).tree["items"][0][1]["local"]
    assert again.spans[0].tensors[0] is a._local_tensor


def test_world_of_one_saves_restores_and_restores_eagerly(mesh: object, tmp_path: Path) -> None:
    a = _dtensor(mesh, torch.arange(4.0))
    state = {"a": a, "step": 1}
    with gpusnap.Checkpointer(tmp_path / "ck", config=gpusnap.Config(collective_timeout_s=60)) as ck:
        info = ck.save(state, tag="one").wait()
        assert info.world_size == 1 and info.stats["save_phases_s"]["coordinate"] >= 0
        a.to_local().zero_()
        state["step"] = 0
        handle = ck.restore(state, lazy=True)
        assert "DTensors" in handle.stats["lazy_refused"] and handle.stats["mode"] == "eager"
        assert state["step"] == 1 and torch.equal(a.to_local(), torch.arange(4.0))
        assert [i.tag for i in ck.list()] == ["one"]
    assert torch.equal(gpusnap.load(tmp_path / "ck")["a"], torch.arange(4.0))
