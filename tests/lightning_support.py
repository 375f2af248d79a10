"""A small Lightning run for the GpusnapCheckpointIO tests (CPU, seconds).

Imported, :func:`fit` trains it; run as a script (``python lightning_support.py DIR EPOCH``)
it is the run SIGKILLed in epoch EPOCH once the previous epoch's checkpoint is durable,
after printing the paths ``ModelCheckpoint`` reported as one JSON line; with a third
argument ``at-pointer`` it is SIGKILLed at the end of epoch EPOCH instead, the moment the
pointer of its committed ``last.ckpt`` is about to be written (:func:`pointer_writes`).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from one_thread import one_thread

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


_armed: dict[str, str] = {}  # path -> "fail" or "kill" (pointer_writes)
_hooked = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _armed or event != "open" or threading.current_thread() is threading.main_thread():
        return
    path, mode = args[0], args[1]
    if not isinstance(path, str) or not isinstance(mode, str) or "w" not in mode:
        return
    for target, action in list(_armed.items()):
        if os.path.dirname(path) == os.path.dirname(target) and os.path.basename(path).startswith(
                os.path.basename(target) + "."):
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.EIO, "injected fault: the pointer file cannot be written", path)


@contextmanager
def pointer_writes(path: str, action: str) -> Iterator[None]:
    """Fault injection at the file layer (a Python audit hook): meanwhile, a file opened for
    writing beside ``path`` under its name plus a suffix (its pointer's temporary file) by a
    thread other than the main one (GpusnapCheckpointIO's pointer thread, which writes once
    the checkpoint is committed) fails with EIO (``"fail"``) or SIGKILLs the process
    (``"kill"``). What the main thread writes (the trainer's own saves) is left alone."""
    target = arm(path, action)
    try:
        yield
    finally:
        _armed.pop(target, None)


def arm(path: str, action: str) -> str:
    """:func:`pointer_writes` from now on, for the rest of the process; returns the path armed."""
    global _hooked
    if not _hooked:  # (a hook stays for the process's life: inert while nothing is armed)
        sys.addaudithook(_audit)
        _hooked = True
    target = os.path.abspath(path)
    _armed[target] = action
    return target


class KillAtPointer(L.Callback):
    """SIGKILL at the end of ``epoch``, as the pointer of ``last.ckpt`` saved then is about to
    be written: that checkpoint is committed, its path does not name it. Prints the step
    the epoch started at first."""

    def __init__(self, io: GpusnapCheckpointIO, epoch: int) -> None:
        self.io, self.epoch = io, epoch

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            self.io.wait()  # the earlier epochs' pointers are written: only this one is cut
            print(json.dumps({"epoch": self.epoch, "global_step": trainer.global_step}), flush=True)
            last = os.path.join(trainer.checkpoint_callback.dirpath, "last.ckpt")
            arm(last, "kill")


def trainer(dirpath: str, io: GpusnapCheckpointIO, *, epochs: int = EPOCHS, callbacks: list[Any] = ()) -> L.Trainer:
    checkpoints = ModelCheckpoint(dirpath=dirpath, monitor="train_loss", save_top_k=2, save_last=True)
    return L.Trainer(max_epochs=epochs, plugins=[io], callbacks=[checkpoints, *callbacks], accelerator="cpu",
                     devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     deterministic=True, default_root_dir=dirpath)


def fit(dirpath: str, *, ckpt_path: str | None = None, kill_in_epoch: int | None = None,
        io: GpusnapCheckpointIO | None = None, epochs: int = EPOCHS, kill_at_pointer: bool = False,
        callbacks: list[Any] = ()) -> tuple[L.Trainer, Net]:
    with one_thread():
        L.seed_everything(0, verbose=False)
        model = Net()
        io = io if io is not None else GpusnapCheckpointIO()
        killer = KillAtPointer if kill_at_pointer else KillAfterSave
        extra = [killer(io, kill_in_epoch)] if kill_in_epoch is not None else []
        run = trainer(dirpath, io, epochs=epochs, callbacks=[*extra, *callbacks])
        run.fit(model, data(), ckpt_path=ckpt_path)
        return run, model


if __name__ == "__main__":
    fit(sys.argv[1], kill_in_epoch=int(sys.argv[2]), kill_at_pointer=sys.argv[3:] == ["at-pointer"])
    sys.exit("the run was not killed")
