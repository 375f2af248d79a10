"""A gpusnap checkpoint of a Hugging Face ``Trainer`` run, written out as the directory
``trainer.train(resume_from_checkpoint=...)`` reads.

The Trainer resumes only from files: it loads the weights (``_load_from_checkpoint``), the
optimizer and scheduler (``_load_optimizer_and_scheduler``), the random generators
(``_load_rng_state``, after it has skipped the batches already trained) and the trainer
state (``TrainerState.load_from_json``: global step, epoch, log history), each from a fixed
name. Reproducing those files lets the Trainer's own resume logic, data skipping included,
do the rest; no private method is overridden. The price: one synchronous write of the
training state to local disk when resuming (what ``torch.save`` costs), never while training.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from gpusnap.state.rng import _as_tuples

__all__ = ["FILES", "hf_rng_state", "write_resume_dir"]

# The names transformers.trainer reads (TRAINER_STATE_NAME, OPTIMIZER_NAME, SCHEDULER_NAME,
# transformers.utils.WEIGHTS_NAME); tests check them against the installed transformers.
FILES = {
    "model": "pytorch_model.bin",  # torch.save keeps tied weights tied; loaded with weights_only=True
    "optimizer": "optimizer.pt",
    "scheduler": "scheduler.pt",
    "rng": "rng_state.pth",
    "trainer_state": "trainer_state.json",
}


def hf_rng_state(saved: dict[str, Any]) -> dict[str, Any]:
    """``gpusnap.RNGState``'s state dict as the Trainer's ``rng_state.pth`` holds it."""
    import numpy as np

    state: dict[str, Any] = {"python": _as_tuples(saved["python"]), "cpu": saved["torch"].to(torch.uint8)}
    if "numpy" in saved:
        n = saved["numpy"]
        state["numpy"] = (n["algorithm"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                          n["cached_gaussian"])
    if "cuda" in saved and torch.cuda.is_available():  # a single process's: the current device's
        state["cuda"] = saved["cuda"][torch.cuda.current_device()].to(torch.uint8)
    return state


def write_resume_dir(state: dict[str, Any], directory: str) -> str:
    """Write ``state`` (what ``gpusnap.load`` returned for a ``GpusnapCallback`` checkpoint)
    as a Trainer checkpoint directory at ``directory``, replacing what is there; returns it.
    Written under a temporary name and renamed: a directory that exists is complete."""
    tmp = f"{directory}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    torch.save(state["model"], os.path.join(tmp, FILES["model"]))
    for key in ("optimizer", "scheduler"):
        if state.get(key) is not None:
            torch.save(state[key], os.path.join(tmp, FILES[key]))
    torch.save(hf_rng_state(state["rng"]), os.path.join(tmp, FILES["rng"]))
    with open(os.path.join(tmp, FILES["trainer_state"]), "w", encoding="utf-8") as f:
        f.write(state["trainer_state"])
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory

