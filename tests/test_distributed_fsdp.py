"""DTensor / FSDP2 state on gloo ranks (CPU): stored as local shards with their layout,
restored in place with the same layout, resharded 4 -> 2 -> 1 and 1 -> 2 (dist_workers.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_support import run_ranks
from torch import nn

import gpusnap
from gpusnap.cli.main import main as cli_main
from gpusnap.storage.manifest import DISTRIBUTED_VERSION, VERSION
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The roots the ranks made (one set of runs for the tests of this module)."""
    tmp_path = tmp_path_factory.mktemp("fsdp")
    plain = plain_model(3)
    plain["model"](torch.randn(4, 5)).square().mean().backward()  # type: ignore[operator]
    plain["optim"].step()  # type: ignore[attr-defined]
    with gpusnap.Checkpointer(tmp_path / "plain") as ck:  # one process: the 1 -> 2 source
        ck.save(plain).wait()
    torch.save(whole(plain), tmp_path / "plain-full.pt")

    run_ranks("fsdp_save", 4, tmp_path)
    run_ranks("fsdp_reshard", 2, tmp_path)
    return tmp_path


def test_fsdp2_reshards_4_to_2_to_1_and_1_to_2(runs: Path) -> None:
    tmp_path = runs
    repo = Repository.open(tmp_path / "fsdp4")
    glob = repo.resolve("step3")
    parts = repo.rank_manifests(glob)  # type: ignore[attr-defined]
    assert glob.world_size == 4
    versions = [json.loads((tmp_path / "fsdp4" / path).read_text())["version"]
                for path in (f"manifests/{glob.id}.json", f"ranks/1/manifests/{glob.id}.json")]
    assert versions == [DISTRIBUTED_VERSION, VERSION]  # (an older gpusnap refuses the global one)
    # the replicated DTensor is stored by rank 0 only: the other ranks record its layout
    rep = [leaf for path, leaf in _leaves(parts[1]) if path == "rep"][0]
    assert rep["local"] is None and [leaf for path, leaf in _leaves(parts[0]) if path == "rep"][0]["local"]

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


def test_tools_read_distributed_checkpoints(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = str(runs / "fsdp4")
    assert cli_main(["ls", root]) == 0
    out = capsys.readouterr().out
    assert "RANKS" in out.splitlines()[0] and out.splitlines()[1].split()[-1] == "4"
    assert cli_main(["show", root, "step3"]) == 0
    out = capsys.readouterr().out
    assert "over 4 ranks" in out and "model/0.weight" in out and "S(0) mesh [4]" in out
    assert cli_main(["ls", root, "--json"]) == 0
    assert [c["world_size"] for c in json.loads(capsys.readouterr().out)["checkpoints"]] == [4, 4]
    assert cli_main(["verify", root]) == 0
    assert "2 checkpoint(s)" in capsys.readouterr().out
    assert cli_main(["gc", root, "--keep-last", "1"]) == 0
    capsys.readouterr()
    assert [p.name for p in (runs / "fsdp4" / "ranks" / "3" / "manifests").iterdir()] == [
        f"{gpusnap.Checkpointer(root).latest().id}.json"]  # type: ignore[union-attr]
    repo = Repository.open(root)
    part = repo.rank_manifests(repo.resolve(None))[2]  # type: ignore[attr-defined]
    path, offset, _length = repo._locate(next(s.chunks[0] for s in part.storages if s.chunks), "")
    pack = Path(repo.backend.describe(path))
    data = bytearray(pack.read_bytes())
    data[offset] ^= 0xFF  # a byte of a chunk rank 2 stored
    pack.write_bytes(bytes(data))
    assert cli_main(["verify", root]) == 1
    assert "does not match its digest" in capsys.readouterr().out
