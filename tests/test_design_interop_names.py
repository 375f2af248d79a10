"""The Interop surface exactly as DESIGN.md names it: ``gpusnap.load``, ``restore(strict=False)``
and the command line (export/import with ``--format``, ``-o``, ``--keys``, ``--key``; diff, du;
``--json`` on ls/show/verify; ``--version``), each used in the form written there."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import gpusnap
from gpusnap.cli.main import main


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_interop_names_of_the_design(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = _model()
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    root = str(tmp_path / "ckpt")
    app_state = {"model": model, "optim": optim, "step": 0}
    with gpusnap.Checkpointer(root, keep_last=3) as ckpt:
        a = ckpt.save(app_state, tag="first").wait()
        with torch.no_grad():
            model[0].weight.add_(1)
        app_state["step"] = 1
        b = ckpt.save(app_state).wait()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}

    sd = gpusnap.load(root, checkpoint=None, keys=None, device="cpu")
    assert sorted(sd) == ["model", "optim", "step"] and sd["step"] == 1 and _equal(sd["model"], weights)
    assert list(gpusnap.load(root, "first", keys=["model"])) == ["model"]

    fresh = _model()
    handle = gpusnap.Checkpointer(root).restore({"model": fresh, "extra": 0}, strict=False)
    handle.wait()
    assert handle.stats["missing"] == ["extra"] and handle.stats["unexpected"] == ["optim", "step"]
    assert _equal(fresh.state_dict(), weights)

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"gpusnap {gpusnap.__version__}"

    out = tmp_path / "out"
    out.mkdir()
    readers = {
        "safetensors": lambda p: load_file(p),
        "torch": lambda p: torch.load(p, weights_only=True),
        "dcp": lambda p: _dcp_read(p, weights),
    }
    for fmt, read in readers.items():
        path = str(out / f"model.{fmt}")
        assert main(["export", root, b.id, "--format", fmt, "-o", path, "--keys", "model"]) == 0
        assert _equal(read(path), weights), fmt
        imported = str(tmp_path / f"imported-{fmt}")
        assert main(["import", path, imported, "--key", "model"]) == 0
        back = _model()
        gpusnap.Checkpointer(imported).restore({"model": back}).wait()
        assert _equal(back.state_dict(), weights), fmt
    capsys.readouterr()

    assert main(["diff", root, a.id, b.id]) == 0
    assert "model/0.weight" in capsys.readouterr().out
    assert main(["du", root]) == 0
    capsys.readouterr()
    for command, schema in (("ls", "gpusnap.ls/1"), ("show", "gpusnap.show/1"), ("verify", "gpusnap.verify/1")):
        assert main([command, root, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["schema"] == schema

    broken = out / "broken.safetensors"
    broken.write_bytes((out / "model.safetensors").read_bytes()[:100])
    assert main(["import", str(broken), str(tmp_path / "never"), "--key", "model"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(broken) in lines[0] and "truncated" in lines[0]
    assert not (tmp_path / "never").exists()


def _dcp_read(path: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {k: torch.zeros_like(v) for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("torch.distributed is disabled ... a single process")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return state
