"""``GpusnapCallback``: a Hugging Face ``Trainer`` checkpointed by gpusnap while it trains.

Every ``save_steps`` optimizer steps (``on_step_end``, after the step, the scheduler step and
``global_step += 1``, where the Trainer would save) the callback saves the model, optimizer,
LR scheduler, random generators and trainer state into a gpusnap root; ``save()`` returns
while the bytes are written. :meth:`GpusnapCallback.resume_path` turns the newest one into
the directory the Trainer resumes from (:mod:`.hf_layout`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from typing import Any

from transformers import TrainerCallback

from gpusnap.checkpointer import Checkpointer
from gpusnap.config import Config
from gpusnap.errors import CheckpointError, CheckpointNotFoundError
from gpusnap.handles import PendingSave
from gpusnap.integrations import roots
from gpusnap.restore.template_free import load
from gpusnap.state.rng import RNGState
from gpusnap.storage.repository import Repository

from .hf_layout import write_resume_dir

__all__ = ["GpusnapCallback"]

log = logging.getLogger("gpusnap")


class GpusnapCallback(TrainerCallback):
    """Checkpoint a ``Trainer`` into the gpusnap root ``root`` every ``save_steps`` steps.

    Use it instead of the Trainer's own saves (``save_strategy="no"``), and resume with the
    newest checkpoint (``resume_path()`` returns None when there is none yet, so the same
    script starts or resumes):

    >>> callback = GpusnapCallback("runs/gpusnap", save_steps=500)                 # doctest: +SKIP
    >>> trainer = Trainer(model, TrainingArguments("runs/out", save_strategy="no"),
    ...                   train_dataset=data, callbacks=[callback])              # doctest: +SKIP
    >>> trainer.train(resume_from_checkpoint=callback.resume_path())              # doctest: +SKIP

    A save that failed is raised by the next save's step or at the end of training.
    ``keep_last`` and ``config`` go to the :class:`gpusnap.Checkpointer`. Single process.
    A root a save could not use (a file, a directory that is neither empty nor a gpusnap
    root, one that cannot be created) is refused here, before training, and the root is
    created now if it does not exist.
    """

    def __init__(self, root: str | os.PathLike[str], save_steps: int, *, keep_last: int | None = None,
                 config: Config | None = None) -> None:
        if not isinstance(save_steps, int) or isinstance(save_steps, bool) or save_steps < 1:
            raise ValueError(f"save_steps must be a positive integer, got {save_steps!r}")
        self.root = os.fspath(root)
        _refuse_unusable(self.root, config)
        self.save_steps = save_steps
        self.keep_last = keep_last
        self.config = config
        self._checkpointer: Checkpointer | None = None
        self._pending: list[PendingSave] = []
        self._resume_dirs: list[str] = []  # written by resume_path(); removed at the end of training
        self._tags: set[str] = set()  # in the root (read when it is opened) or given since

    # -- events -------------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(args, "save_strategy", "no") != "no":  # (a str enum: SaveStrategy.NO == "no")
            log.warning("gpusnap: the Trainer also writes its own checkpoints (save_strategy=%r); with "
                        "GpusnapCallback pass save_strategy='no' to train without their stalls", args.save_strategy)

    def on_step_end(self, args: Any, state: Any, control: Any, *, model: Any = None, optimizer: Any = None,
                    lr_scheduler: Any = None, **kwargs: Any) -> None:
        if state.global_step % self.save_steps == 0:
            self.save(state, control, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Every save durable (the first failure raised), the root released, and the
        directories ``resume_path()`` wrote (read by now) removed."""
        try:
            self.close()
        finally:
            for directory in self._resume_dirs:
                shutil.rmtree(directory, ignore_errors=True)
            self._resume_dirs.clear()

    # -- saving -------------------------------------------------------------------------------
    def save(self, state: Any, control: Any, *, model: Any, optimizer: Any, lr_scheduler: Any) -> PendingSave:
        """Save now (``on_step_end`` calls it); first raises an earlier save's failure."""
        if model is None:
            raise ValueError("GpusnapCallback needs the model: the Trainer passes it to every event")
        self._raise_finished()
        checkpointer = self._open()
        app_state = {
            "model": model,
            "optimizer": optimizer,
            "scheduler": lr_scheduler,
            "rng": RNGState(),
            "trainer_state": _trainer_state_json(state, control),
            "global_step": int(state.global_step),
        }
        pending = checkpointer.save(app_state, tag=self._tag_for(int(state.global_step)))
        self._pending.append(pending)
        return pending

    def wait(self) -> None:
        """Block until every save so far is durable; raises the first that failed."""
        pending, self._pending = self._pending, []
        for p in pending:
            p.wait()

    def close(self) -> None:
        """:meth:`wait`, then release the root (the next save opens it again; another
        GpusnapCallback of this process that uses it keeps it open)."""
        try:
            self.wait()
        finally:
            if self._checkpointer is not None:
                self._checkpointer = None
                roots.release(self)

    # -- resuming -----------------------------------------------------------------------------
    def resume_path(self, directory: str | os.PathLike[str] | None = None, checkpoint: str | None = None) -> str | None:
        """The newest checkpoint (or ``checkpoint``: an id or a tag such as ``"step-500"``)
        written out as a Trainer checkpoint directory, for ``train(resume_from_checkpoint=...)``;
        None when the root holds none. ``directory``: where (default ``<root>-resume/
        checkpoint-<step>``, replaced each call, removed at the end of training)."""
        self.wait()
        checkpointer = self._open()
        checkpointer.wait()  # saves of the root still in flight here (a Trainer that raised)
        self._tags = {info.tag for info in checkpointer.list()}  # (theirs included)
        try:
            state = load(self.root, checkpoint, config=self.config)
        except CheckpointNotFoundError:
            if checkpoint is not None:
                raise
            return None
        missing = sorted({"model", "rng", "trainer_state"} - set(state))
        if missing:
            raise CheckpointNotFoundError(f"the checkpoint in {self.root} was not written by GpusnapCallback "
                                          f"(it lacks {missing})")
        if directory is None:
            parent = f"{self.root.rstrip('/')}-resume"
            if "://" in parent:
                raise ValueError(f"{self.root} is not a local root: pass resume_path(directory=...) on local disk")
            shutil.rmtree(parent, ignore_errors=True)  # (what an interrupted resume left)
            directory = os.path.join(parent, f"checkpoint-{state['global_step']}")
            self._resume_dirs.append(parent)
        os.makedirs(os.path.dirname(os.path.abspath(directory)), exist_ok=True)
        return write_resume_dir(state, os.fspath(directory))

    # -- helpers ------------------------------------------------------------------------------
    def _open(self) -> Checkpointer:
        if self._checkpointer is None:
            self._checkpointer = roots.acquire(self.root, self, keep_last=self.keep_last, config=self.config)
            self._tags = {info.tag for info in self._checkpointer.list()}
        return self._checkpointer

    def _tag_for(self, step: int) -> str:
        """``step-N``; a step saved before (a run resumed from an older checkpoint) gets
        ``step-N.2``, ``step-N.3``... (a tag names one checkpoint)."""
        tag, again = f"step-{step}", 1
        while tag in self._tags:
            again += 1
            tag = f"step-{step}.{again}"
        self._tags.add(tag)
        return tag

    def _raise_finished(self) -> None:
        """Raise the failure of a save that has finished; forget the finished ones."""
        done = [p for p in self._pending if p.done()]
        self._pending = [p for p in self._pending if not p.done()]
        for p in done:
            p.wait()


def _refuse_unusable(root: str, config: Config | None) -> None:
    """Open ``root`` for saving as a Checkpointer's first save does (``Repository.open`` with
    ``create=True``: the same checks, the same root made), so that a root it would refuse
    fails now rather than at the first save, after ``save_steps`` steps of training."""
    try:
        Repository.open(root, create=True, config=config).close()
    except CheckpointError as exc:
        raise type(exc)(f"GpusnapCallback cannot save into {root}: {exc}") from exc


def _trainer_state_json(state: Any, control: Any) -> str:
    """``trainer_state.json`` as the Trainer's own save writes it: the control's state updated
    (other stateful callbacks are out of a callback's reach: theirs is as at the last load)."""
    document = dataclasses.asdict(state)
    callbacks = dict(document.get("stateful_callbacks") or {})
    if control is not None and hasattr(control, "state"):
        callbacks[type(control).__name__] = control.state()
    document["stateful_callbacks"] = callbacks
    return json.dumps(document, indent=2, sort_keys=True) + "\n"
