"""GpusnapCheckpointIO's paths without a Trainer: overwrite, removal (pending or not, links,
copies), failures that surface, files from TorchCheckpointIO, and bad input."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from test_lifecycle_unobserved_errors import full_disk  # noqa: E402,F401  (a fixture)

import gpusnap  # noqa: E402
from gpusnap.integrations.lightning import ROOT_NAME, GpusnapCheckpointIO, resolve  # noqa: E402


def _checkpoint(value: float) -> dict[str, Any]:
    return {"state_dict": {"w": torch.full((64,), value)}, "epoch": int(value), "hyper_parameters": {"lr": 0.1}}


def _ids(folder: Path) -> set[str]:
    with gpusnap.Checkpointer(folder / ROOT_NAME) as root:
        return {i.id for i in root.list()}


def test_a_save_returns_before_it_is_durable_and_keeps_the_state_of_its_call(tmp_path, gate):
    io, path = GpusnapCheckpointIO(), tmp_path / "a.ckpt"
    w = torch.zeros(1 << 16)
    io.save_checkpoint({"state_dict": {"w": w}}, path)  # returns while its chunks cannot be stored
    with pytest.raises(gpusnap.CheckpointNotFoundError, match="no checkpoint is committed"):
        resolve(path)  # a placeholder until the checkpoint is durable: it names nothing yet
    w.add_(1)  # training goes on, in place
    gate.release()
    io.wait()
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], torch.zeros(1 << 16))
    io.teardown()


def test_saving_a_path_again_replaces_its_checkpoint(tmp_path):
    io, path = GpusnapCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint(_checkpoint(1), path)
    io.save_checkpoint(_checkpoint(2), path)  # (maybe before the first one committed)
    io.wait()
    got = io.load_checkpoint(path)
    assert got["epoch"] == 2 and torch.equal(got["state_dict"]["w"], torch.full((64,), 2.0))
    io.teardown()
    assert _ids(tmp_path) == {resolve(path).checkpoint}


def test_removing_a_path_deletes_its_checkpoint_even_while_it_is_saved(tmp_path):
    io = GpusnapCheckpointIO()
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    io.save_checkpoint(_checkpoint(1), a)
    io.save_checkpoint(_checkpoint(2), b)
    io.remove_checkpoint(a)  # committed or not yet: either way no pointer and no checkpoint stay
    io.teardown()
    assert sorted(os.listdir(tmp_path)) == [ROOT_NAME, "b.ckpt"]
    assert _ids(tmp_path) == {resolve(b).checkpoint}


def test_a_link_or_a_copy_keeps_the_checkpoint_it_names(tmp_path):
    io = GpusnapCheckpointIO()
    epoch, link, copy = tmp_path / "epoch=1.ckpt", tmp_path / "last.ckpt", tmp_path / "copy.ckpt"
    io.save_checkpoint(_checkpoint(1), epoch)
    io.wait()
    os.symlink(epoch.name, link)  # what ModelCheckpoint(save_last="link") makes
    shutil.copy(epoch, copy)
    io.remove_checkpoint(link)  # only the link goes
    assert io.load_checkpoint(epoch)["epoch"] == 1
    io.remove_checkpoint(epoch)  # the copy still names it
    assert io.load_checkpoint(copy)["epoch"] == 1
    io.remove_checkpoint(copy)
    io.teardown()
    assert os.listdir(tmp_path) == [ROOT_NAME] and _ids(tmp_path) == set()


def test_an_explicit_root_serves_every_directory(tmp_path):
    io = GpusnapCheckpointIO(root=tmp_path / "root")
    io.save_checkpoint(_checkpoint(1), tmp_path / "x" / "a.ckpt")
    io.save_checkpoint(_checkpoint(2), tmp_path / "y" / "b.ckpt")
    io.teardown()
    assert resolve(tmp_path / "y" / "b.ckpt").root == str(tmp_path / "root")
    assert GpusnapCheckpointIO().load_checkpoint(tmp_path / "x" / "a.ckpt")["epoch"] == 1


def test_two_plug_ins_in_one_process_share_the_root_and_each_other_s_saves(tmp_path):
    first, second = GpusnapCheckpointIO(), GpusnapCheckpointIO()  # (two Trainers, one after the other)
    path = tmp_path / "manual.ckpt"
    first.save_checkpoint(_checkpoint(1), path)  # as trainer.save_checkpoint after fit: no teardown follows
    assert second.load_checkpoint(path)["epoch"] == 1  # waits for that save, committed or not yet
    second.save_checkpoint(_checkpoint(2), tmp_path / "b.ckpt")  # the root has one writer: shared
    second.teardown()
    first.save_checkpoint(_checkpoint(3), path)  # the root stays open while the first one uses it
    first.teardown()
    assert len(_ids(tmp_path)) == 2 and second.load_checkpoint(path)["epoch"] == 3


def test_files_of_torch_checkpoint_io_still_load_and_remove(tmp_path):
    path = tmp_path / "old.ckpt"
    TorchCheckpointIO().save_checkpoint(_checkpoint(3), path)
    io = GpusnapCheckpointIO()
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], torch.full((64,), 3.0))
    io.remove_checkpoint(path)
    assert not path.exists()


def test_the_random_generators_come_back_with_a_checkpoint(tmp_path):
    io, path = GpusnapCheckpointIO(), tmp_path / "a.ckpt"
    torch.manual_seed(5)
    io.save_checkpoint(_checkpoint(1), path)
    want = torch.rand(3)
    io.load_checkpoint(path)
    assert torch.equal(torch.rand(3), want)
    io.teardown()


def test_a_failed_save_is_raised_by_the_next_save_or_at_teardown(full_disk, tmp_path):
    io = GpusnapCheckpointIO(root=full_disk[0])  # a root on a full disk: saves fail in the background
    with pytest.raises(gpusnap.CheckpointError, match=r"a\.ckpt failed.*No space left"):
        io.save_checkpoint(_checkpoint(1), tmp_path / "a.ckpt")
        io.save_checkpoint(_checkpoint(2), tmp_path / "b.ckpt")  # raises if a's failure is known by now
        io.teardown()  # else this does
    io.teardown()  # the failures were raised: the second teardown only releases the root
    assert not (tmp_path / "a.ckpt").exists()


def test_bad_input_is_refused_clearly(tmp_path):
    io, path = GpusnapCheckpointIO(), tmp_path / "a.ckpt"
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint(_checkpoint(1), path, storage_options={"x": 1})
    with pytest.raises(ValueError, match="local filesystem"):
        io.save_checkpoint(_checkpoint(1), "s3://bucket/a.ckpt")
    with pytest.raises(ValueError, match="gpusnap_rng"):
        io.save_checkpoint({**_checkpoint(1), "gpusnap_rng": 1}, path)
    with pytest.raises(gpusnap.CheckpointError, match="hyper_parameters/obj.*allow_pickle"):
        io.save_checkpoint({**_checkpoint(1), "hyper_parameters": {"obj": object()}}, path)
    with pytest.raises(FileNotFoundError, match="not found"):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    io.save_checkpoint(_checkpoint(1), path)
    with pytest.raises(TypeError, match="map_location"):
        io.load_checkpoint(path, map_location=lambda storage, loc: storage)
    io.teardown()
