"""accelerate: checkpoint what ``Accelerator.save_state`` saves with a ``gpusnap.Checkpointer``.

A recipe with one helper, not hooks. ``Accelerator.register_save_state_pre_hook`` hands its
hook only the models and their state dicts (``hook(models, weights, output_dir)``); the
optimizers, schedulers, samplers, gradient scaler and random generators are then written by
``save_accelerator_state`` with ``torch.save``, synchronously, and no hook can take them
over (``load_state`` then requires those files). Routing the weights alone through gpusnap
would keep most of the stall. So :func:`accelerator_state` builds the ``app_state`` for a
Checkpointer, which saves it concurrently and restores it in place:

>>> accelerator = Accelerator()                                                  # doctest: +SKIP
>>> model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)  # doctest: +SKIP
>>> app_state = accelerator_state(accelerator, model=model, optimizer=optimizer,
...                               scheduler=scheduler, epoch=0, batch=0)         # doctest: +SKIP
>>> ckpt = gpusnap.Checkpointer("runs/ckpt", keep_last=2)                        # doctest: +SKIP
>>> if ckpt.latest() is not None: ckpt.restore(app_state)                        # doctest: +SKIP

docs/integrations/accelerate.md has the whole loop, with the exact resume in the middle of
an epoch (``accelerator.skip_first_batches``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from gpusnap.integrations import require
from gpusnap.state.rng import RNGState

require("accelerate", "accelerate")

__all__ = ["AcceleratorCounters", "accelerator_state", "resume_epoch"]


class AcceleratorCounters:
    """Stateful: what ``save_state`` keeps of the Accelerator itself: its ``step`` counter
    (gradient accumulation) and, with fp16 mixed precision, its gradient scaler."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        """The accelerator's step counter and its grad scaler's state, if it has one."""
        state: dict[str, Any] = {"step": int(self.accelerator.step)}
        if self.accelerator.scaler is not None:
            state["scaler"] = self.accelerator.scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Put the step counter and the grad scaler's state back."""
        self.accelerator.step = int(state_dict["step"])
        if "scaler" in state_dict and self.accelerator.scaler is not None:
            self.accelerator.scaler.load_state_dict(state_dict["scaler"])


def accelerator_state(accelerator: Any, **objects: Any) -> dict[str, Any]:
    """An ``app_state`` with ``objects`` under their names (prepared models, optimizers,
    schedulers, your counters as plain values) plus what ``Accelerator.save_state`` would
    also save: ``"accelerator"`` (:class:`AcceleratorCounters`) and ``"rng"`` (every random
    generator: torch, CUDA, Python, NumPy).

    >>> from accelerate import Accelerator
    >>> sorted(accelerator_state(Accelerator(cpu=True), step=0))
    ['accelerator', 'rng', 'step']
    """
    taken = sorted({"accelerator", "rng"} & objects.keys())
    if taken:
        raise ValueError(f"accelerator_state() names {taken} itself: give your objects other names")
    return {**objects, "accelerator": AcceleratorCounters(accelerator), "rng": RNGState()}


def resume_epoch(accelerator: Any, loader: Iterable[Any], batches_done: int) -> Iterator[Any]:
    """The batches of the epoch a checkpoint was taken in that come after the first
    ``batches_done`` (``accelerator.skip_first_batches``), with the random generators left
    as restored. A DataLoader draws its base seed from torch's generator as its first batch
    is fetched; the run being resumed made that draw when the epoch began, before the
    checkpoint, so here the generators are put back after the first batch (as the
    Trainer's own resume does). With ``batches_done == 0`` this is the plain loader.

    >>> for x, y in resume_epoch(accelerator, loader, app_state["batch"]): ...   # doctest: +SKIP
    """
    if batches_done == 0:
        return iter(loader)
    return _after_first(iter(accelerator.skip_first_batches(loader, batches_done)), RNGState().state_dict())


def _after_first(batches: Iterator[Any], generators: dict[str, Any]) -> Iterator[Any]:
    try:
        first = next(batches)
    except StopIteration:  # (the checkpoint was taken after the epoch's last batch)
        return
    finally:
        RNGState().load_state_dict(generators)
    yield first
    yield from batches
