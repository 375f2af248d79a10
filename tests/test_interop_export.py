"""``gpusnap.export``: every format read back by its own tool (``safetensors.torch.load_file``,
``torch.load(weights_only=True)``, ``torch.distributed.checkpoint.load``) as the same tensors,
bit for bit; dotted names; what each format cannot keep, reported; nothing half-written."""

from __future__ import annotations

import copy
import errno
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fast_support import same
from restore_support import corrupt_chunk, tiny_config
from safetensors.torch import load_file
from test_load_without_template import _Tied  # tied weights, a bfloat16 and a transposed buffer

import gpusnap
from gpusnap.cli.main import main
from gpusnap.interop import FormatError, torch_format


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Tied()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.head(model.emb(torch.arange(6))).square().sum().backward()
    optim.step()
    base = torch.randn(6, 10)
    return {
        "model": model,
        "optim": optim,
        "views": {"base": base, "t": base.t(), "row": base[3]},
        "dtypes": [torch.randn(7).half(), torch.arange(-5, 5, dtype=torch.int8), torch.rand(9) > 0.5,
                   torch.randn(4, dtype=torch.float64), torch.randn(3).to(torch.float8_e4m3fn)],
        "step": 7,
        "name": "run",
    }


def _expected(state: dict[str, Any]) -> dict[str, Any]:
    """The dotted names an export of ``state`` holds, tensors as saved."""
    out: dict[str, Any] = {f"model.{k}": v for k, v in state["model"].state_dict().items()}
    optim = state["optim"].state_dict()
    for index, moments in optim["state"].items():
        out |= {f"optim.state.{index}.{k}": v for k, v in moments.items()}
    out["optim.param_groups"] = optim["param_groups"]
    out |= {f"views.{k}": v for k, v in state["views"].items()}
    out |= {f"dtypes.{i}": v for i, v in enumerate(state["dtypes"])}
    return out | {"step": 7, "name": "run"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("export") / "ck"
    state = _state()
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        ck.save(state, tag="t", blocking=True).wait()
    return root, _expected(state)


def _tensors(names: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in names.items() if isinstance(v, torch.Tensor)}


def _plain(names: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in names.items() if not isinstance(v, torch.Tensor)}


def test_safetensors_reads_back_the_tensors_and_reports_what_it_left_out(saved, tmp_path: Path) -> None:
    root, expected = saved
    out = tmp_path / "all.safetensors"
    report = gpusnap.export(root, out, format="safetensors")
    got = load_file(out)
    assert same(got, _tensors(expected)) == []
    assert got["model.scale"].dtype == torch.bfloat16
    assert set(report.skipped) == set(_plain(expected))
    assert dict(report.copies) == {"model.head.weight": "model.emb.weight", "views.t": "views.base",
                                   "views.row": "views.base"}
    assert (report.tensors, report.values) == (len(got), 0)
    assert report.checkpoint == gpusnap.Checkpointer(root).latest().id
    assert any("not written" in n for n in report.notes()) and any("copies" in n for n in report.notes())


def test_torch_keeps_plain_values_and_shared_storage(saved, tmp_path: Path) -> None:
    root, expected = saved
    out = tmp_path / "all.pt"
    report = gpusnap.export(root, out, format="torch", checkpoint="t")
    got = torch.load(out, weights_only=True)
    assert list(got) == list(expected)
    assert same(got, expected) == []
    assert got["model.head.weight"].data_ptr() == got["model.emb.weight"].data_ptr()
    assert got["views.row"].untyped_storage().data_ptr() == got["views.base"].untyped_storage().data_ptr()
    assert report.skipped == () and report.copies == () and report.values == 3


def test_dcp_loads_into_a_template_with_plain_values(saved, tmp_path: Path) -> None:
    root, expected = saved
    out = tmp_path / "all.dcp"
    report = gpusnap.export(root, out, format="dcp")
    # a DCP user's template: tensors to fill, plain values of the same structure (DCP flattens
    # containers of plain values itself: optim.param_groups.0.lr)
    template = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in expected.items()}
    template |= {"step": -1, "name": ""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(template, checkpoint_id=str(out), no_dist=True)
    assert same(template, expected) == []
    assert ("model.head.weight", "model.emb.weight") in report.copies and report.skipped == ()


def test_one_selected_entry_exports_its_own_state_dict_names(saved, tmp_path: Path) -> None:
    root, expected = saved
    out = tmp_path / "model.safetensors"
    gpusnap.export(root, out, format="safetensors", keys=["model"])
    model = _Tied()
    model.load_state_dict(load_file(out))  # strict: exactly model.state_dict()'s names
    assert same(dict(model.state_dict()), {k[len("model."):]: v for k, v in expected.items()
                                           if k.startswith("model.")}) == []
    gpusnap.export(root, tmp_path / "state.pt", format="torch", keys=[("optim", "state")])
    assert sorted(torch.load(tmp_path / "state.pt", weights_only=True)) == sorted(
        k[len("optim.state."):] for k in expected if k.startswith("optim.state."))
    gpusnap.export(root, tmp_path / "full.pt", format="torch", keys=["model"], full_names=True)
    assert all(k.startswith("model.") for k in torch.load(tmp_path / "full.pt", weights_only=True))
    gpusnap.export(root, tmp_path / "one.pt", format="torch", keys=["views.row"])  # a tensor: its full name
    assert list(torch.load(tmp_path / "one.pt", weights_only=True)) == ["views.row"]


def test_keys_select_what_is_exported(saved, tmp_path: Path) -> None:
    root, expected = saved
    out = tmp_path / "some.pt"
    gpusnap.export(root, out, format="torch", keys=["views.row", ("dtypes",), "step"])
    got = torch.load(out, weights_only=True)
    assert sorted(got) == sorted(["views.row", "step"] + [f"dtypes.{i}" for i in range(5)])


def test_a_dtype_safetensors_cannot_hold_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        ck.save({"z": torch.randn(3, dtype=torch.complex128), "w": torch.ones(2)}, blocking=True).wait()
    out = tmp_path / "out" / "z.safetensors"
    out.parent.mkdir()
    with pytest.raises(FormatError, match=r"z.safetensors: safetensors cannot hold dtype torch.complex128 \(z\)"):
        gpusnap.export(root, out, format="safetensors")
    assert os.listdir(out.parent) == []  # no temporary file either
    gpusnap.export(root, out.with_suffix(".pt"), format="torch")
    assert torch.equal(torch.load(out.with_suffix(".pt"), weights_only=True)["z"], gpusnap.load(root)["z"])


def test_names_that_collide_or_keys_without_a_name_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        ck.save({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}, "t": {(1, 2): torch.ones(1)}}, blocking=True)
    with pytest.raises(FormatError, match=r"\('a.b',\) and \('a', 'b'\) would both be named 'a.b'"):
        gpusnap.export(root, tmp_path / "x.pt", format="torch")
    with pytest.raises(FormatError, match=r"key \(1, 2\) \(tuple\) has no dotted name"):
        gpusnap.export(root, tmp_path / "x.pt", format="torch", keys=["t"])
    gpusnap.export(root, tmp_path / "x.pt", format="torch", keys=[("a", "b")])
    assert list(torch.load(tmp_path / "x.pt", weights_only=True)) == ["a.b"]


def test_an_existing_destination_is_kept_unless_overwrite(saved, tmp_path: Path) -> None:
    root, expected = saved
    out = tmp_path / "keep.pt"
    out.write_bytes(b"mine")
    with pytest.raises(FileExistsError, match="keep.pt exists"):
        gpusnap.export(root, out, format="torch")
    assert out.read_bytes() == b"mine"
    gpusnap.export(root, out, format="torch", overwrite=True)
    assert same(torch.load(out, weights_only=True), expected) == []
    folder = tmp_path / "keep.dcp"
    gpusnap.export(root, folder, format="dcp", keys=["step"])
    gpusnap.export(root, folder, format="dcp", keys=["name"], overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["keep.dcp", "keep.pt"]


def test_a_corrupt_checkpoint_exports_nothing_and_exits_2(tmp_path: Path, capsys) -> None:
    root = tmp_path / "ck"
    marked = torch.arange(4096, dtype=torch.float32)
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        ck.save({"marked": marked}, blocking=True).wait()
    corrupt_chunk(root, marked[:64].numpy().tobytes(), at=100)
    out = tmp_path / "out.safetensors"
    assert main(["export", str(root), "--format", "safetensors", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpusnap: error:") and "marked" in err[0] and str(out) in err[0]
    assert "packs/" in err[0] or str(root) in err[0]  # the checkpoint file that is corrupt
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_cli_export_prints_what_it_wrote_and_warns_what_it_left_out(saved, tmp_path: Path, capsys) -> None:
    root, expected = saved
    out = tmp_path / "x.safetensors"
    assert main(["export", str(root), "t", "--format", "safetensors", "-o", str(out), "--keys", "model", "step"]) == 0
    captured = capsys.readouterr()
    assert f"to {out} (safetensors): 6 tensor(s)" in captured.out
    assert "1 plain value(s) not written" in captured.err and "model.head.weight (shared with model.emb.weight)" in captured.err
    assert main(["export", str(root), "--format", "torch", "-o", str(tmp_path / "n.pt"), "--keys", '["step"]']) == 0
    assert torch.load(tmp_path / "n.pt", weights_only=True) == {"step": 7}


def test_without_the_safetensors_package_the_error_says_how_to_install_it(
    saved, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = saved
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # import fails as if not installed
    with pytest.raises(FormatError, match="pip install safetensors"):
        gpusnap.export(root, tmp_path / "x.safetensors", format="safetensors")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()],
                         ids=["disk-full", "ctrl-c"])
def test_a_write_failing_halfway_leaves_nothing(saved, tmp_path: Path, monkeypatch, error) -> None:
    root, _ = saved

    def half(names: Any, path: Any) -> None:
        Path(path).write_bytes(b"half a file")
        raise error

    monkeypatch.setattr(torch_format.torch, "save", half)
    with pytest.raises(type(error)) as caught:
        gpusnap.export(root, tmp_path / "x.pt", format="torch")
    if isinstance(error, OSError):
        assert "writing" in str(caught.value) and "x.pt" in str(caught.value) and caught.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []
