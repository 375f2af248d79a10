"""GpusnapCallback under a real Hugging Face Trainer (CPU): exact resume after SIGKILL through
the Trainer's own resume_from_checkpoint, and checkpoints equal to the state of their step."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import transformers_support as run  # noqa: E402
from integration_support import assert_equal_tensors, run_killed  # noqa: E402
from test_lifecycle_unobserved_errors import full_disk  # noqa: E402,F401  (a fixture)
from one_thread import one_thread  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import gpusnap  # noqa: E402
from gpusnap.integrations.transformers import GpusnapCallback  # noqa: E402
from gpusnap.integrations.transformers.hf_layout import FILES  # noqa: E402


class _Record(TrainerCallback):
    """The model's state at each step that GpusnapCallback saves (it runs just before)."""

    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
        if state.global_step % run.SAVE_STEPS == 0:
            self.weights[state.global_step] = {k: v.clone() for k, v in model.state_dict().items()}


def test_resume_after_sigkill_is_bit_exact(tmp_path):
    root, out = str(tmp_path / "gpusnap"), str(tmp_path / "out")
    assert run_killed("transformers_support.py", root, out) == {"step": run.KILL_AT}

    resumed = run.train(root, out, resume=True)  # from step 4: 4 batches of epoch 0 skipped
    assert resumed.state.global_step == run.EPOCHS * run.STEPS_PER_EPOCH
    assert not os.path.exists(f"{root}-resume")  # what resume_path() wrote is gone once read

    record = _Record()
    callback = GpusnapCallback(str(tmp_path / "straight"), save_steps=run.SAVE_STEPS)
    straight = run.trainer(str(tmp_path / "out2"), [record, callback])
    with one_thread():  # (as run.train: the same sums, bit for bit)
        straight.train()
    assert_equal_tensors(resumed.model.state_dict(), straight.model.state_dict())
    for got, want in zip(resumed.optimizer.state_dict()["state"].values(),
                         straight.optimizer.state_dict()["state"].values()):
        assert_equal_tensors(got, want)
    assert resumed.lr_scheduler.state_dict() == straight.lr_scheduler.state_dict()

    # each checkpoint holds the state of its step, not of a later one the copy overlapped
    for step, weights in record.weights.items():
        assert_equal_tensors(gpusnap.load(str(tmp_path / "straight"), f"step-{step}")["model"], weights)


def test_resume_path_is_none_on_a_fresh_root_and_refuses_a_foreign_checkpoint(tmp_path):
    assert GpusnapCallback(str(tmp_path / "new"), save_steps=3).resume_path() is None
    with gpusnap.Checkpointer(str(tmp_path / "other")) as ckpt:
        ckpt.save({"w": torch.zeros(2)}).wait()
    with pytest.raises(gpusnap.CheckpointNotFoundError, match="not written by GpusnapCallback"):
        GpusnapCallback(str(tmp_path / "other"), save_steps=3).resume_path()
    with pytest.raises(gpusnap.CheckpointNotFoundError):
        GpusnapCallback(str(tmp_path / "new"), save_steps=3).resume_path(checkpoint="step-9")


def test_a_failed_save_stops_training(full_disk, tmp_path):
    callback = GpusnapCallback(str(full_disk[0]), save_steps=2)  # a root on a full disk
    with pytest.raises(gpusnap.StorageError, match="No space left"):
        run.trainer(str(tmp_path / "out"), [callback]).train()  # at the next save, or at the end
    with contextlib.suppress(gpusnap.CheckpointError):  # (the saves still in flight failed too)
        callback.close()


@pytest.mark.parametrize("steps", [0, -1, 2.5, True])
def test_save_steps_must_be_a_positive_integer(steps):
    with pytest.raises(ValueError, match="save_steps"):
        GpusnapCallback("unused", save_steps=steps)


def test_the_files_are_those_the_trainer_reads():
    from transformers import trainer as hf_trainer
    from transformers.utils import WEIGHTS_NAME

    assert FILES == {"model": WEIGHTS_NAME, "optimizer": hf_trainer.OPTIMIZER_NAME,
                     "scheduler": hf_trainer.SCHEDULER_NAME, "rng": "rng_state.pth",
                     "trainer_state": hf_trainer.TRAINER_STATE_NAME}
