"""gpusnap.integrations.accelerate: an accelerate loop checkpointed with a Checkpointer resumes
bit-exactly after SIGKILL, in the middle of an epoch or at its end."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")

import accelerate_support as run  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from integration_support import assert_equal_tensors, run_killed  # noqa: E402

from gpusnap.integrations.accelerate import AcceleratorCounters, accelerator_state  # noqa: E402


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return run.train(str(tmp_path_factory.mktemp("straight") / "ckpt")).state_dict()


def test_resume_after_sigkill_in_the_middle_of_an_epoch_is_bit_exact(tmp_path, straight):
    root = str(tmp_path / "ckpt")
    assert run_killed("accelerate_support.py", root, "5") == {"step": 5}  # the last save: step 4
    assert_equal_tensors(run.train(root).state_dict(), straight)


def test_resume_from_an_epoch_s_last_step_is_bit_exact(tmp_path, straight):
    root = str(tmp_path / "ckpt")
    with pytest.raises(run.Stopped):
        run.train(root, stop_at=run.STEPS_PER_EPOCH + 1)  # the last save: step 6, epoch 0's last
    assert_equal_tensors(run.train(root).state_dict(), straight)


def test_the_accelerator_counters_round_trip():
    accelerator = Accelerator(cpu=True)
    counters = AcceleratorCounters(accelerator)
    accelerator.step = 7
    saved = counters.state_dict()
    accelerator.step = 0
    counters.load_state_dict(saved)
    assert saved == {"step": 7} and accelerator.step == 7


def test_reserved_names_are_refused():
    with pytest.raises(ValueError, match="rng"):
        accelerator_state(Accelerator(cpu=True), rng=torch.zeros(1))
