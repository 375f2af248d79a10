"""A tiny Hugging Face Trainer run for the GpusnapCallback tests (GPT-2 from a config, CPU).

Imported, :func:`train` runs it; as a script (``python transformers_support.py ROOT OUT``) it
is the run SIGKILLed at step ``KILL_AT``, once the save of step ``SAVE_STEPS`` is durable.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from one_thread import one_thread

from gpusnap.integrations.transformers import GpusnapCallback

STEPS_PER_EPOCH = 6
EPOCHS = 2
SAVE_STEPS = 4  # saves at 4 and 8: resuming from 4 skips 4 batches of epoch 0
KILL_AT = 7


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (8 * STEPS_PER_EPOCH, 12), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class KillAt(TrainerCallback):
    def __init__(self, callback: GpusnapCallback) -> None:
        self.callback = callback

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == KILL_AT:
            self.callback.wait()
            print(json.dumps({"step": state.global_step}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)  # (tied input and output embeddings, dropout everywhere)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))


def trainer(out: str, callbacks: list[Any]) -> Trainer:
    args = TrainingArguments(out, per_device_train_batch_size=8, num_train_epochs=EPOCHS, learning_rate=3e-3,
                             lr_scheduler_type="linear", warmup_steps=2, save_strategy="no", report_to="none",
                             logging_steps=1, disable_tqdm=True, use_cpu=True, seed=0, dataloader_num_workers=0)
    return Trainer(model(), args, train_dataset=Tokens(), callbacks=callbacks)


def train(root: str, out: str, *, resume: bool = False, kill: bool = False) -> Trainer:
    with one_thread():
        callback = GpusnapCallback(root, save_steps=SAVE_STEPS)
        run = trainer(out, [callback] + ([KillAt(callback)] if kill else []))
        run.train(resume_from_checkpoint=callback.resume_path() if resume else None)
        return run


if __name__ == "__main__":
    train(sys.argv[1], sys.argv[2], kill=True)
    sys.exit("the run was not killed")
