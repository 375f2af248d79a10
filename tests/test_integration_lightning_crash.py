"""GpusnapCheckpointIO after a crash between a checkpoint's commit and its pointer: the path
(and ``fit(ckpt_path="last")``) still leads to the newest checkpoint committed for it.

The crash is placed exactly: the pointer is written on the plug-in's thread once the
checkpoint is committed, and a file-layer fault (``lightning_support.pointer_writes``, an
audit hook) fails that write, or SIGKILLs the process as it starts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning")

import lightning_support as run  # noqa: E402
from integration_support import assert_equal_tensors, run_killed  # noqa: E402
from lightning_support import pointer_writes  # noqa: E402

import gpusnap  # noqa: E402
from gpusnap.integrations.lightning import ROOT_NAME, GpusnapCheckpointIO, resolve  # noqa: E402


def _checkpoint(value: float) -> dict[str, Any]:
    return {"state_dict": {"w": torch.full((64,), value)}, "epoch": int(value)}


def _ids(folder: Path) -> list[str]:
    with gpusnap.Checkpointer(folder / ROOT_NAME) as root:
        return [i.id for i in root.list()]


def _save_without_pointer(io: GpusnapCheckpointIO, checkpoint: dict[str, Any], path: Path) -> None:
    """Save ``path``: the checkpoint commits, its pointer cannot be written (then the process
    would have died); the failure is reported."""
    with pointer_writes(str(path), "fail"):
        io.save_checkpoint(checkpoint, path)
        with pytest.raises(gpusnap.CheckpointError):
            io.wait()


def test_a_first_checkpoint_whose_pointer_was_never_written_is_what_its_path_loads(tmp_path):
    io, path = GpusnapCheckpointIO(), tmp_path / "last.ckpt"
    _save_without_pointer(io, _checkpoint(1), path)
    io.teardown()
    [committed] = _ids(tmp_path)

    after = GpusnapCheckpointIO()  # as in the next process
    assert after.load_checkpoint(path)["epoch"] == 1
    assert resolve(path) == gpusnap.integrations.lightning.Pointer(str(tmp_path / ROOT_NAME), committed)


def test_a_newer_checkpoint_than_the_pointer_names_is_what_its_path_loads(tmp_path):
    io, path = GpusnapCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint(_checkpoint(1), path)
    io.wait()
    _save_without_pointer(io, _checkpoint(2), path)  # the file still names checkpoint 1
    io.teardown()

    after = GpusnapCheckpointIO()
    got = after.load_checkpoint(path)
    assert got["epoch"] == 2 and torch.equal(got["state_dict"]["w"], torch.full((64,), 2.0))

    after.save_checkpoint(_checkpoint(3), path)  # saving it again frees what the crash left
    after.teardown()
    assert _ids(tmp_path) == [resolve(path).checkpoint]


def test_a_placeholder_ignores_what_an_earlier_file_at_its_path_saved(tmp_path, gate):
    io, path = GpusnapCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint(_checkpoint(1), path)
    gate.release()
    io.wait()
    os.remove(path)  # by hand: checkpoint 1 stays in the root, recorded for this path

    gate.open.clear()
    io.save_checkpoint(_checkpoint(2), path)  # its chunks held: not committed yet
    with pytest.raises(gpusnap.CheckpointNotFoundError, match="no checkpoint is committed"):
        resolve(path)  # not checkpoint 1, from before the file was removed
    gate.release()
    io.teardown()
    assert GpusnapCheckpointIO().load_checkpoint(path)["epoch"] == 2


class _StartStep(L.Callback):
    """The global step training (re)starts at, once a checkpoint is restored."""

    def __init__(self) -> None:
        self.step: int | None = None

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.step = trainer.global_step


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    _, model = run.fit(str(tmp_path_factory.mktemp("straight")))
    return model.state_dict()


@pytest.mark.parametrize("epoch", [0, 2], ids=["first-last-ckpt", "later-last-ckpt"])
def test_fit_from_last_resumes_the_checkpoint_committed_just_before_a_sigkill(tmp_path, epoch, straight):
    folder = str(tmp_path / "killed")
    reported = run_killed("lightning_support.py", folder, str(epoch), "at-pointer")
    assert reported["epoch"] == epoch

    start = _StartStep()
    trainer, resumed = run.fit(folder, ckpt_path="last", callbacks=[start])
    assert start.step == (epoch + 1) * run.STEPS_PER_EPOCH  # the end of the killed epoch, not before
    assert trainer.global_step == run.EPOCHS * run.STEPS_PER_EPOCH
    assert_equal_tensors(resumed.state_dict(), straight)


def test_a_link_to_a_path_whose_pointer_was_never_written_loads_its_checkpoint(tmp_path):
    io, top, last = GpusnapCheckpointIO(), tmp_path / "epoch=0.ckpt", tmp_path / "last.ckpt"
    _save_without_pointer(io, _checkpoint(1), top)
    os.symlink(top.name, last)  # what ModelCheckpoint(save_last="link") makes, right after the save
    io.teardown()
    assert GpusnapCheckpointIO().load_checkpoint(last)["epoch"] == 1
