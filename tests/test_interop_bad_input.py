"""Issue 24's acceptance for import and export: a corrupt, truncated or unsupported file is one
CLI error line naming the file and what is wrong, exit status 2, and nothing half-written:
an import leaves the root without a new checkpoint (a root it would create is not created),
an export leaves nothing at its destination. Reading never runs code from the file."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from restore_support import tiny_config
from safetensors.torch import save_file

import gpusnap
from gpusnap.cli.main import main


def _safetensors(where: Path) -> Path:
    save_file({"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(3)}, where)
    return where


def _torch_file(where: Path) -> Path:
    torch.save({"w": torch.arange(64, dtype=torch.float32)}, where)
    return where


def _dcp(where: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(64, dtype=torch.float32), "step": 1}, checkpoint_id=str(where), no_dist=True)
    return where


def _cut(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


class _Marker:
    """Unpickling it would create a file: proof that code from the file ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def _empty(tmp: Path) -> tuple[Path, str]:
    (tmp / "e.safetensors").write_bytes(b"")
    return tmp / "e.safetensors", "empty file"


def _garbage(tmp: Path) -> tuple[Path, str]:
    (tmp / "g.bin").write_bytes(b"this is not a checkpoint\n" * 4)
    return tmp / "g.bin", "unsupported file"


def _truncated_header(tmp: Path) -> tuple[Path, str]:
    path = _safetensors(tmp / "t.safetensors")
    _cut(path, 40)
    return path, "truncated safetensors file"


def _truncated_data(tmp: Path) -> tuple[Path, str]:
    path = _safetensors(tmp / "d.safetensors")
    _cut(path, path.stat().st_size - 10)
    return path, "not a readable safetensors file"


def _bad_header_json(tmp: Path) -> tuple[Path, str]:
    header = b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 99]}}'
    (tmp / "h.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\x00" * 16)
    return tmp / "h.safetensors", "not a readable safetensors file"


def _truncated_zip(tmp: Path) -> tuple[Path, str]:
    path = _torch_file(tmp / "z.pt")
    _cut(path, path.stat().st_size // 2)
    return path, "not a readable torch.save file"


def _code_in_torch_file(tmp: Path) -> tuple[Path, str]:
    torch.save({"w": torch.ones(1), "evil": _Marker(str(tmp / "RAN"))}, tmp / "evil.pt")
    return tmp / "evil.pt", "refused by torch.load(weights_only=True)"


def _dcp_without_data(tmp: Path) -> tuple[Path, str]:
    path = _dcp(tmp / "nodata.dcp")
    for name in os.listdir(path):
        if name.endswith(".distcp"):
            os.unlink(path / name)
    return path, "the DCP checkpoint cannot be read"


def _dcp_truncated_data(tmp: Path) -> tuple[Path, str]:
    path = _dcp(tmp / "cut.dcp")
    for name in os.listdir(path):
        if name.endswith(".distcp"):
            _cut(path / name, 50)
    return path, "the DCP checkpoint cannot be read"


def _dcp_code_in_metadata(tmp: Path) -> tuple[Path, str]:
    path = tmp / "evil.dcp"
    path.mkdir()
    (path / ".metadata").write_bytes(pickle.dumps(_Marker(str(tmp / "RAN"))))
    return path, "refused or unreadable DCP metadata"


def _hf(tmp: Path, weight_map: dict[str, str]) -> Path:
    """A model directory whose index places tensors as ``weight_map`` says."""
    path = tmp / "hf"
    path.mkdir()
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def _hf_missing_shard(tmp: Path) -> tuple[Path, str]:
    path = _hf(tmp, {"w": "model-00001-of-00002.safetensors", "x": "model-00002-of-00002.safetensors"})
    save_file({"w": torch.ones(2)}, path / "model-00001-of-00002.safetensors")
    return path, "model-00002-of-00002.safetensors: missing"


def _hf_shard_outside(tmp: Path) -> tuple[Path, str]:
    _safetensors(tmp / "outside.safetensors")
    return _hf(tmp, {"w": "../outside.safetensors", "b": "../outside.safetensors"}), "is not a file name in"


def _hf_index_disagrees(tmp: Path) -> tuple[Path, str]:
    path = _hf(tmp, {"w": "model-00001-of-00001.safetensors"})
    _safetensors(path / "model-00001-of-00001.safetensors")  # it also holds "b"
    return path, "the index and its shards disagree"


def _hf_index_not_json(tmp: Path) -> tuple[Path, str]:
    path = tmp / "hf"
    path.mkdir()
    (path / "model.safetensors.index.json").write_text("{ nope")
    return path, "not a readable JSON index"


def _unsupported_dir(tmp: Path) -> tuple[Path, str]:
    (tmp / "dir").mkdir()
    (tmp / "dir" / "weights.npz").write_bytes(b"x")
    return tmp / "dir", "unsupported directory"


def _missing(tmp: Path) -> tuple[Path, str]:
    return tmp / "nowhere.safetensors", "no such file or directory"


CASES: list[Callable[[Path], tuple[Path, str]]] = [
    _empty, _garbage, _truncated_header, _truncated_data, _bad_header_json, _truncated_zip, _code_in_torch_file,
    _dcp_without_data, _dcp_truncated_data, _dcp_code_in_metadata, _hf_missing_shard, _hf_shard_outside,
    _hf_index_disagrees, _hf_index_not_json, _unsupported_dir, _missing,
]


def _one_error_line(err: str, path: Path, problem: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"gpusnap: error: {path}") or lines[0].startswith("gpusnap: error: " + str(path.parent))
    assert str(path.name) in lines[0] and problem in lines[0], lines[0]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__.strip("_") for c in CASES])
def test_a_bad_input_is_one_line_exit_2_and_no_new_root(tmp_path: Path, case, capsys) -> None:
    path, problem = case(tmp_path)
    root = tmp_path / "root"
    assert main(["import", str(path), str(root), "--key", "model"]) == 2
    _one_error_line(capsys.readouterr().err, path, problem)
    assert not root.exists()
    assert not (tmp_path / "RAN").exists()  # nothing from the file was executed


@pytest.mark.parametrize("case", [_truncated_data, _code_in_torch_file, _dcp_code_in_metadata, _hf_missing_shard],
                         ids=lambda c: c.__name__.strip("_"))
def test_a_bad_input_leaves_an_existing_root_as_it_was(tmp_path: Path, case, capsys) -> None:
    root = tmp_path / "root"
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        before = ck.save({"w": torch.ones(4)}, blocking=True).wait()
    files = sorted(p.relative_to(root) for p in root.rglob("*"))
    path, problem = case(tmp_path)
    assert main(["import", str(path), str(root)]) == 2
    _one_error_line(capsys.readouterr().err, path, problem)
    assert [i.id for i in gpusnap.Checkpointer(root).list()] == [before.id]
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == files


def test_a_file_holding_values_a_checkpoint_cannot_store_is_refused_before_the_root(tmp_path: Path, capsys) -> None:
    torch.save({"w": torch.ones(2), "s": {1, 2}}, tmp_path / "set.pt")  # a set: weights_only loads it, save() cannot
    assert main(["import", str(tmp_path / "set.pt"), str(tmp_path / "root")]) == 2
    _one_error_line(capsys.readouterr().err, tmp_path / "set.pt", "cannot be stored")
    assert not (tmp_path / "root").exists()


def test_a_bare_tensor_needs_a_key(tmp_path: Path, capsys) -> None:
    torch.save(torch.arange(3), tmp_path / "t.pt")
    assert main(["import", str(tmp_path / "t.pt"), str(tmp_path / "root")]) == 2
    _one_error_line(capsys.readouterr().err, tmp_path / "t.pt", "pass key=NAME (--key NAME)")
    assert main(["import", str(tmp_path / "t.pt"), str(tmp_path / "root"), "--key", "t"]) == 0
    assert torch.equal(gpusnap.load(tmp_path / "root")["t"], torch.arange(3))


def test_export_refusals_are_one_line_exit_2_and_leave_nothing(tmp_path: Path, capsys) -> None:
    root = tmp_path / "root"
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        ck.save({"z": torch.zeros(2, dtype=torch.complex128), "a.b": torch.ones(1), "a": {"b": torch.ones(1)}},
                blocking=True).wait()
    out = tmp_path / "out"
    out.mkdir()
    for argv, problem in (
        (["--format", "safetensors", "-o", str(out / "z.safetensors"), "--keys", "z"], "cannot hold dtype torch.complex128"),
        (["--format", "torch", "-o", str(out / "a.pt")], "would both be named 'a.b'"),
        (["--format", "dcp", "-o", str(out / "x" / "y.dcp"), "--keys", "z"], "no such directory"),
        (["--format", "torch", "-o", str(out / "k.pt"), "--keys", "nope"], "name nothing"),
    ):
        assert main(["export", str(root), *argv]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("gpusnap: error:") and problem in lines[0], lines
    assert os.listdir(out) == []
    assert main(["export", str(tmp_path / "nowhere"), "--format", "torch", "-o", str(out / "n.pt")]) == 2
    assert "no checkpoint root" in capsys.readouterr().err and os.listdir(out) == []
