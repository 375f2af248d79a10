"""Issue 37, hostile input: ``gpusnap import DIR ROOT`` reads only files inside ``DIR``. A DCP
``.metadata`` naming ``../..`` or an absolute storage path, a file or directory in ``DIR``
that links out of it (a shard, ``model.safetensors``, the index, ``.metadata`` itself), or a
link swapped in after the check: each is a FormatError naming the entry, the CLI's one error
line (exit 2), and the root stays as it was. The secret file outside holds values that must
never reach a checkpoint. A link that stays inside ``DIR`` is followed."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from restore_support import tiny_config
from safetensors.torch import save_file

import gpusnap
from gpusnap.cli.main import main
from gpusnap.interop import FormatError

SECRET = torch.full((64,), 31337.0)
PUBLIC = torch.arange(64, dtype=torch.float32)


def _dcp(where: Path, tensor: torch.Tensor) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": tensor}, checkpoint_id=str(where), no_dist=True)
    return where


def _data_file(where: Path) -> Path:
    (found,) = [p for p in where.iterdir() if p.suffix == ".distcp"]
    return found


def _metadata_naming(where: Path, source: Path, relpath: Callable[[str], str]) -> None:
    """``where/.metadata``: the metadata of the DCP directory ``source`` with each storage
    path rewritten by ``relpath`` (offsets and lengths stay those of ``source``'s files)."""
    meta = pickle.loads((source / ".metadata").read_bytes())
    for info in meta.storage_data.values():
        info.relative_path = relpath(info.relative_path)
    where.mkdir(parents=True, exist_ok=True)
    (where / ".metadata").write_bytes(pickle.dumps(meta))


def _secret_dcp(tmp: Path) -> Path:
    return _dcp(tmp / "outside" / "secret.dcp", SECRET)


def _dcp_dotdot(tmp: Path) -> tuple[Path, str]:
    secret = _secret_dcp(tmp)
    path = tmp / "in" / "evil.dcp"
    _metadata_naming(path, secret, lambda rel: f"../../outside/secret.dcp/{rel}")
    return path, "../../outside/secret.dcp/"


def _dcp_absolute(tmp: Path) -> tuple[Path, str]:
    secret = _secret_dcp(tmp)
    path = tmp / "in" / "evil.dcp"
    _metadata_naming(path, secret, lambda rel: str(secret / rel))
    return path, str(secret)


def _dcp_data_link(tmp: Path) -> tuple[Path, str]:
    secret = _secret_dcp(tmp)
    path = _dcp(tmp / "in" / "evil.dcp", PUBLIC)
    data = _data_file(path)
    data.unlink()
    data.symlink_to(_data_file(secret))
    return path, data.name


def _dcp_directory_link(tmp: Path) -> tuple[Path, str]:
    secret = _secret_dcp(tmp)
    path = tmp / "in" / "evil.dcp"
    _metadata_naming(path, secret, lambda rel: f"data/{rel}")
    (path / "data").symlink_to(secret, target_is_directory=True)
    return path, "data/"


def _dcp_metadata_link(tmp: Path) -> tuple[Path, str]:
    secret = _secret_dcp(tmp)
    path = _dcp(tmp / "in" / "evil.dcp", PUBLIC)
    (path / ".metadata").unlink()
    (path / ".metadata").symlink_to(secret / ".metadata")
    return path, ".metadata"


def _hf_single_link(tmp: Path) -> tuple[Path, str]:
    (tmp / "outside").mkdir()
    save_file({"w": SECRET}, tmp / "outside" / "secret.safetensors")
    path = tmp / "in" / "hf"
    path.mkdir(parents=True)
    (path / "model.safetensors").symlink_to(tmp / "outside" / "secret.safetensors")
    return path, "model.safetensors"


def _hf_bin_link(tmp: Path) -> tuple[Path, str]:
    (tmp / "outside").mkdir()
    torch.save({"w": SECRET}, tmp / "outside" / "secret.pt")
    path = tmp / "in" / "hf"
    path.mkdir(parents=True)
    (path / "pytorch_model.bin").symlink_to(tmp / "outside" / "secret.pt")
    return path, "pytorch_model.bin"


def _hf_index(path: Path, weight_map: dict[str, str]) -> None:
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _hf_shard_link(tmp: Path) -> tuple[Path, str]:
    (tmp / "outside").mkdir()
    save_file({"b": SECRET}, tmp / "outside" / "secret.safetensors")
    path = tmp / "in" / "hf"
    path.mkdir(parents=True)
    _hf_index(path, {"w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    save_file({"w": PUBLIC}, path / "model-00001-of-00002.safetensors")
    (path / "model-00002-of-00002.safetensors").symlink_to(tmp / "outside" / "secret.safetensors")
    return path, "model-00002-of-00002.safetensors"


def _hf_index_link(tmp: Path) -> tuple[Path, str]:
    (tmp / "outside").mkdir()
    _hf_index(tmp / "outside", {"w": "model-00001-of-00001.safetensors"})
    path = tmp / "in" / "hf"
    path.mkdir(parents=True)
    save_file({"w": PUBLIC}, path / "model-00001-of-00001.safetensors")
    (path / "model.safetensors.index.json").symlink_to(tmp / "outside" / "model.safetensors.index.json")
    return path, "model.safetensors.index.json"


CASES: list[Callable[[Path], tuple[Path, str]]] = [
    _dcp_dotdot, _dcp_absolute, _dcp_data_link, _dcp_directory_link, _dcp_metadata_link,
    _hf_single_link, _hf_bin_link, _hf_shard_link, _hf_index_link,
]
_IDS = [c.__name__.strip("_") for c in CASES]


def _no_secret(root: Path) -> None:
    """No checkpoint in ``root`` holds the secret's values, at any depth."""
    def leaves(value: Any) -> list[Any]:
        return [x for v in value.values() for x in leaves(v)] if isinstance(value, dict) else [value]

    for info in gpusnap.Checkpointer(root).list():
        for value in leaves(gpusnap.load(root, info.id)):
            assert not (isinstance(value, torch.Tensor) and torch.equal(value, SECRET))


@pytest.mark.parametrize("case", CASES, ids=_IDS)
def test_an_import_that_would_read_outside_its_directory_is_refused(tmp_path: Path, case) -> None:
    path, entry = case(tmp_path)
    root = tmp_path / "root"
    with pytest.raises(FormatError) as raised:
        gpusnap.import_(path, root, config=tiny_config())
    message = str(raised.value)
    assert isinstance(raised.value, gpusnap.CheckpointError)
    assert message.startswith(str(path)) and entry in message and "refused" in message, message
    assert "inside the directory" in message, message
    assert not root.exists()


@pytest.mark.parametrize("case", CASES, ids=_IDS)
def test_the_cli_refuses_with_one_line_and_leaves_the_root_as_it_was(tmp_path: Path, case, capsys) -> None:
    root = tmp_path / "root"
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        before = ck.save({"w": torch.ones(4)}, blocking=True).wait()
    files = sorted(p.relative_to(root) for p in root.rglob("*"))
    path, entry = case(tmp_path)
    capsys.readouterr()
    assert main(["import", str(path), str(root), "--key", "model"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gpusnap: error: {path}") and entry in lines[0], lines
    assert [i.id for i in gpusnap.Checkpointer(root).list()] == [before.id]
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == files
    _no_secret(root)


def _racing(monkeypatch: pytest.MonkeyPatch, victim: Path, secret: Path) -> None:
    """An attacker who swaps ``victim`` (a regular file, inside) for a link to ``secret``
    right after the first check of its real path (``os.path.realpath``, the filesystem's
    answer, faked): every check sees the file as it was, only the open can tell."""
    real = os.path.realpath
    seen = real(victim)

    def realpath(p: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(p, (str, os.PathLike)) and os.path.abspath(p) == seen:
            if not os.path.islink(seen):
                os.unlink(seen)
                os.symlink(secret, seen)
            return seen
        return real(p, *args, **kwargs)

    monkeypatch.setattr(os.path, "realpath", realpath)


def test_a_dcp_file_swapped_for_a_link_after_the_check_is_not_followed(tmp_path: Path, monkeypatch) -> None:
    secret = _secret_dcp(tmp_path)
    path = _dcp(tmp_path / "in" / "evil.dcp", PUBLIC)
    _racing(monkeypatch, _data_file(path), _data_file(secret))
    with pytest.raises(FormatError, match="changed into a link while it was opened") as raised:
        gpusnap.import_(path, tmp_path / "root")
    assert _data_file(path).name in str(raised.value)
    assert not (tmp_path / "root").exists()


def test_an_hf_shard_swapped_for_a_link_after_the_check_is_not_followed(tmp_path: Path, monkeypatch) -> None:
    path, _ = _hf_shard_link(tmp_path)
    shard = path / "model-00002-of-00002.safetensors"
    shard.unlink()
    save_file({"b": PUBLIC}, shard)
    _racing(monkeypatch, shard, tmp_path / "outside" / "secret.safetensors")
    with pytest.raises(FormatError, match="changed into a link while it was opened") as raised:
        gpusnap.import_(path, tmp_path / "root")
    assert shard.name in str(raised.value)
    assert not (tmp_path / "root").exists()


def test_links_that_stay_inside_the_directory_are_followed_and_one_leading_out_is_not(tmp_path: Path) -> None:
    # A DCP directory whose data file lives in a subdirectory reached through a link, and a
    # sharded HF directory whose shard is a link to a blob beside it: both inside, both read.
    path = _dcp(tmp_path / "in" / "ok.dcp", PUBLIC)
    data = _data_file(path)
    (path / "blobs").mkdir()
    shutil.move(data, path / "blobs" / "data")
    data.symlink_to(Path("blobs") / "data")
    assert torch.equal(gpusnap.load(tmp_path / "r1", gpusnap.import_(path, tmp_path / "r1").id)["w"], PUBLIC)

    hf = tmp_path / "in" / "hf"
    hf.mkdir()
    _hf_index(hf, {"w": "model-00001-of-00001.safetensors"})
    save_file({"w": PUBLIC}, hf / "blob")
    (hf / "model-00001-of-00001.safetensors").symlink_to("blob")
    assert torch.equal(gpusnap.load(tmp_path / "r2", gpusnap.import_(hf, tmp_path / "r2").id)["w"], PUBLIC)

    # The same directory once its blob is a link out of it: refused, the secret not read.
    (tmp_path / "outside").mkdir()
    save_file({"w": SECRET}, tmp_path / "outside" / "secret.safetensors")
    (hf / "blob").unlink()
    (hf / "blob").symlink_to(tmp_path / "outside" / "secret.safetensors")
    with pytest.raises(FormatError, match="a link to .*secret.safetensors, outside"):
        gpusnap.import_(hf, tmp_path / "r3")
    assert not (tmp_path / "r3").exists()
