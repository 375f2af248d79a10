"""``gpusnap.import_`` / ``gpusnap import``: each format committed as one ordinary checkpoint
(verified by ``gpusnap verify``) that restores into live objects bit for bit: a module from a
safetensors file or a Hugging Face directory (``ckpt.restore`` and ``cold_start``), a
training state from a ``torch.save`` file or a DCP directory."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fast_support import same, snapshot
from restore_support import tiny_config
from safetensors.torch import save_file
from torch import nn

import gpusnap
from gpusnap.cli.main import main


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    model.register_buffer("scale", torch.randn(3, 2).to(torch.bfloat16))
    return model


def _trained() -> dict[str, Any]:
    model = _model(0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 6)).square().sum().backward()
    optim.step()
    return {"model": model, "optim": optim}


def _state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def _restored(root: Path, checkpoint: str) -> nn.Module:
    target = _model(1)  # other values: everything must come from the checkpoint
    weight = target[0].weight
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        ck.restore({"model": target}, checkpoint).wait()
    assert target[0].weight is weight  # in place
    return target


def _cold(root: Path, checkpoint: str) -> nn.Module:
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        model, handle = gpusnap.cold_start(lambda: _model(2), ck, device="cpu", checkpoint=checkpoint, key="model")
        handle.wait()
    return model


def _hf_dir(where: Path, tensors: dict[str, torch.Tensor], shards: int) -> Path:
    """A ``save_pretrained``-style directory: ``shards`` safetensors shards and their index."""
    where.mkdir()
    names = list(tensors)
    if shards == 1:
        save_file(tensors, where / "model.safetensors", metadata={"format": "pt"})
        return where
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, where / shard, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, shard)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (where / "model.safetensors.index.json").write_text(json.dumps(index))
    return where


@pytest.mark.parametrize("layout", ["file", "hf-single", "hf-sharded"])
def test_a_state_dict_file_restores_into_a_module_bit_exactly(tmp_path: Path, layout: str, capsys) -> None:
    source = _model(0)
    tensors = _state_dict(source)
    if layout == "file":
        path = tmp_path / "model.safetensors"
        save_file(tensors, path)
    else:
        path = _hf_dir(tmp_path / "hf", tensors, 1 if layout == "hf-single" else 3)
    root = tmp_path / "root"
    info = gpusnap.import_(path, root, key="model", tag="imported")
    assert info.tag == "imported" and gpusnap.Checkpointer(root).latest().id == info.id
    assert main(["verify", str(root)]) == 0
    assert same(snapshot({"model": _restored(root, info.id)}), snapshot({"model": source})) == []
    assert same(snapshot({"model": _cold(root, "imported")}), snapshot({"model": source})) == []
    assert same(snapshot(gpusnap.load(root)), snapshot({"model": tensors})) == []


def test_without_a_key_the_files_names_are_the_top_level_keys(tmp_path: Path) -> None:
    tensors = _state_dict(_model(0))
    save_file(tensors, tmp_path / "m.safetensors")
    gpusnap.import_(tmp_path / "m.safetensors", tmp_path / "root")
    loaded = gpusnap.load(tmp_path / "root")
    assert sorted(loaded) == sorted(tensors) and same(loaded, tensors) == []


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_torch_save_training_checkpoint_restores_model_optimizer_and_values(tmp_path: Path, legacy: bool) -> None:
    trained = _trained()
    path = tmp_path / "ckpt.pt"
    content = {"model": trained["model"].state_dict(), "optim": trained["optim"].state_dict(), "epoch": 3,
               "tied": {"a": trained["model"][0].weight, "b": trained["model"][0].weight}}
    torch.save(content, path, _use_new_zipfile_serialization=not legacy)
    root = tmp_path / "root"
    gpusnap.import_(path, root)
    model = _model(1)
    optim = torch.optim.AdamW(model.parameters(), lr=1.0)
    state = {"model": model, "optim": optim, "epoch": 0, "tied": {"a": torch.zeros(8, 6), "b": torch.zeros(8, 6)}}
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        ck.restore(state).wait()
    assert same(snapshot(state), snapshot(trained | {"epoch": 3, "tied": content["tied"]})) == []
    assert optim.param_groups[0]["lr"] == 1e-2
    loaded = gpusnap.load(root, keys=["tied"])["tied"]
    assert loaded["a"].data_ptr() == loaded["b"].data_ptr()  # stored once, as torch.save had it


def test_a_dcp_directory_restores_its_nested_state(tmp_path: Path) -> None:
    trained = _trained()
    content = {"model": _state_dict(trained["model"]), "extra": [torch.arange(4), torch.ones(2, dtype=torch.float64)],
               "step": 11, "name": "run"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(content, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    root = tmp_path / "root"
    gpusnap.import_(tmp_path / "dcp", root)
    model = _model(1)
    state = {"model": model, "extra": [torch.zeros(4, dtype=torch.int64), torch.zeros(2, dtype=torch.float64)],
             "step": 0, "name": ""}
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        ck.restore(state).wait()
    assert same(snapshot(state), snapshot({"model": trained["model"]} | {k: content[k] for k in ("extra", "step", "name")})) == []


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "dcp"])
def test_export_then_import_round_trips(tmp_path: Path, fmt: str) -> None:
    source = _model(0)
    with gpusnap.Checkpointer(tmp_path / "a", config=tiny_config()) as ck:
        ck.save({"model": source, "step": 5}, blocking=True).wait()
    out = tmp_path / f"model.{fmt}"
    gpusnap.export(tmp_path / "a", out, format=fmt, keys=["model"])  # model's own names, as import --key takes
    gpusnap.import_(out, tmp_path / "b", key="model")
    assert same(snapshot({"model": _restored(tmp_path / "b", None)}), snapshot({"model": source})) == []


def test_cli_import_says_what_it_committed(tmp_path: Path, capsys) -> None:
    save_file(_state_dict(_model(0)), tmp_path / "m.safetensors")
    root = tmp_path / "root"
    assert main(["import", str(tmp_path / "m.safetensors"), str(root), "--key", "model", "--tag", "hf"]) == 0
    out = capsys.readouterr().out
    info = gpusnap.Checkpointer(root).latest()
    assert f"as checkpoint {info.id} (tag hf)" in out and "(safetensors)" in out and "under key 'model'" in out


def test_cli_round_trip_export_keys_model_then_import_key_model(tmp_path: Path) -> None:
    source = _model(0)
    with gpusnap.Checkpointer(tmp_path / "a", config=tiny_config()) as ck:
        ck.save({"model": source, "optim": torch.optim.SGD(source.parameters(), lr=0.1)}, blocking=True).wait()
    out = str(tmp_path / "model.safetensors")
    assert main(["export", str(tmp_path / "a"), "--format", "safetensors", "-o", out, "--keys", "model"]) == 0
    assert main(["import", out, str(tmp_path / "b"), "--key", "model"]) == 0
    assert same(snapshot({"model": _restored(tmp_path / "b", None)}), snapshot({"model": source})) == []
