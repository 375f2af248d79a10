"""A small accelerate training loop checkpointed with gpusnap, for the accelerate tests.

Imported, :func:`train` runs it (resuming from ``root`` when it holds a checkpoint, stopping
at ``stop_at`` with :class:`Stopped`); as a script (``python accelerate_support.py ROOT STEP``)
it is the run SIGKILLed at step STEP, once the saves before it (every ``SAVE_EVERY`` steps)
are durable.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from one_thread import one_thread

import gpusnap
from gpusnap.integrations.accelerate import accelerator_state, resume_epoch

EPOCHS, STEPS_PER_EPOCH, SAVE_EVERY = 2, 6, 2


class Stopped(Exception):
    """A run that ended early, its checkpoints durable."""


def train(root: str, *, stop_at: int | None = None, kill: bool = False) -> nn.Module:
    with one_thread():
        return _train(root, stop_at, kill)


def _train(root: str, stop_at: int | None, kill: bool) -> nn.Module:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    x = torch.randn(8 * STEPS_PER_EPOCH, 4, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)

    app_state = accelerator_state(accelerator, model=model, optimizer=optimizer, scheduler=scheduler,
                                  epoch=0, batch=0, step=0)
    with gpusnap.Checkpointer(root, keep_last=2) as ckpt:
        if ckpt.latest() is not None:
            ckpt.restore(app_state)  # in place; epoch, batch and step come back as saved
        while app_state["epoch"] < EPOCHS:
            loader.set_epoch(app_state["epoch"])  # the seedable sampler's order for this epoch
            for x, y in resume_epoch(accelerator, loader, app_state["batch"]):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                app_state["batch"] += 1
                app_state["step"] += 1
                if app_state["step"] % SAVE_EVERY == 0:
                    ckpt.save(app_state)
                if app_state["step"] == stop_at:
                    ckpt.wait()
                    if not kill:
                        raise Stopped
                    print(json.dumps({"step": app_state["step"]}), flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
            app_state["epoch"] += 1
            app_state["batch"] = 0
    return accelerator.unwrap_model(model)


if __name__ == "__main__":
    train(sys.argv[1], stop_at=int(sys.argv[2]), kill=True)
    sys.exit("the run was not killed")
