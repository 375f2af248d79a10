"""DTensor / FSDP2 state on gloo ranks (CPU): stored as local shards with their layout,
restored in place with the same layout, resharded 4 -> 2 -> 1 and 1 -> 2 (dist_workers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_support import run_ranks
from torch import nn

import gpusnap
from gpusnap.storage.repository import Repository

pytestmark = pytest.mark.slow


def plain_model(seed: int) -> dict[str, object]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2), "step": 0}


def whole(state: dict[str, object]) -> dict[str, torch.Tensor]:
    model, optim = state["model"], state["optim"]
    out = {f"model.{k}": v for k, v in model.state_dict().items()}  # type: ignore[attr-defined]
    for i, moments in optim.state_dict()["state"].items():  # type: ignore[attr-defined]
        out.update({f"optim.{i}.{k}": v for k, v in moments.items()})
    return out


def test_fsdp2_reshards_4_to_2_to_1_and_1_to_2(tmp_path: Path) -> None:
    plain = plain_model(3)
    plain["model"](torch.randn(4, 5)).square().mean().backward()  # type: ignore[operator]
    plain["optim"].step()  # type: ignore[attr-defined]
    with gpusnap.Checkpointer(tmp_path / "plain") as ck:  # one process: the 1 -> 2 source
        ck.save(plain).wait()
    torch.save(whole(plain), tmp_path / "plain-full.pt")

    run_ranks("fsdp_save", 4, tmp_path)
    repo = Repository.open(tmp_path / "fsdp4")
    glob = repo.resolve("step3")
    parts = repo.rank_manifests(glob)  # type: ignore[attr-defined]
    assert glob.world_size == 4
    # the replicated DTensor is stored by rank 0 only: the other ranks record its layout
    rep = [leaf for path, leaf in _leaves(parts[1]) if path == "rep"][0]
    assert rep["local"] is None and [leaf for path, leaf in _leaves(parts[0]) if path == "rep"][0]["local"]

    run_ranks("fsdp_reshard", 2, tmp_path)

    saved = torch.load(tmp_path / "fsdp2-full.pt")  # 2 -> 1: whole tensors in one process
    loaded = gpusnap.load(tmp_path / "fsdp2")
    assert all(torch.equal(loaded["model"][k[len("model."):]], v) for k, v in saved.items() if k.startswith("model."))
    one = plain_model(5)
    handle = gpusnap.Checkpointer(tmp_path / "fsdp2").restore(one, strict=False)
    assert handle.stats["unexpected"] == ["rep"]
    assert whole(one).keys() == saved.keys() and all(torch.equal(whole(one)[k], saved[k]) for k in saved)


def _leaves(manifest: object) -> list[tuple[str, dict[str, object]]]:
    from gpusnap.state.tree import leaves

    return list(leaves(manifest.tree))  # type: ignore[attr-defined]
