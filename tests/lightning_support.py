"""A small Lightning run for the GpusnapCheckpointIO tests (CPU, seconds).

Imported, :func:`fit` trains it; run as a script (``python lightning_support.py DIR EPOCH``)
it is the run SIGKILLed in epoch EPOCH once the previous epoch's checkpoint is durable,
after printing the paths ``ModelCheckpoint`` reported as one JSON line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpusnap.integrations.lightning import GpusnapCheckpointIO

EPOCHS = 4
STEPS_PER_EPOCH = 6


class Net(L.LightningModule):
    """Dropout and a shuffled loader: a resume that loses the random generators diverges."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Dropout(0.3), nn.Linear(width, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)]


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8 * STEPS_PER_EPOCH, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True)


class KillAfterSave(L.Callback):
    """SIGKILL at batch 2 of ``epoch``: the previous epoch's checkpoint is durable, and the
    two steps trained since are lost."""

    def __init__(self, io: GpusnapCheckpointIO, epoch: int) -> None:
        self.io, self.epoch = io, epoch

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch == self.epoch and batch_idx == 2:
            self.io.wait()
            cb = trainer.checkpoint_callback
            print(json.dumps({"last": cb.last_model_path, "best_k": sorted(cb.best_k_models)}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def trainer(dirpath: str, io: GpusnapCheckpointIO, *, epochs: int = EPOCHS, callbacks: list[Any] = ()) -> L.Trainer:
    checkpoints = ModelCheckpoint(dirpath=dirpath, monitor="train_loss", save_top_k=2, save_last=True)
    return L.Trainer(max_epochs=epochs, plugins=[io], callbacks=[checkpoints, *callbacks], accelerator="cpu",
                     devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     deterministic=True, default_root_dir=dirpath)


def fit(dirpath: str, *, ckpt_path: str | None = None, kill_in_epoch: int | None = None,
        io: GpusnapCheckpointIO | None = None, epochs: int = EPOCHS) -> tuple[L.Trainer, Net]:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    model = Net()
    io = io if io is not None else GpusnapCheckpointIO()
    extra = [KillAfterSave(io, kill_in_epoch)] if kill_in_epoch is not None else []
    run = trainer(dirpath, io, epochs=epochs, callbacks=extra)
    run.fit(model, data(), ckpt_path=ckpt_path)
    return run, model


if __name__ == "__main__":
    fit(sys.argv[1], kill_in_epoch=int(sys.argv[2]))
    sys.exit("the run was not killed")
