"""``load_from_checkpoint(YourModule, path)``: ``LightningModule.load_from_checkpoint`` for a
path that ``GpusnapCheckpointIO`` saved.

Lightning's own ``load_from_checkpoint`` reads the file with ``torch.load``, never through a
``CheckpointIO``; on a pointer file that fails with a message naming this function
(:data:`.pointer.HEADER`). This loads the checkpoint through the plug-in and hands it to
Lightning's ``load_from_checkpoint`` as an in-memory file, so hyper-parameters,
``on_load_checkpoint``, ``strict`` and ``map_location`` behave as they do there. The price:
one ``torch.save`` of the checkpoint into memory while loading.
"""

from __future__ import annotations

import io
import os
from typing import Any, TypeVar

import torch

from gpusnap.config import Config

from .checkpoint_io import GpusnapCheckpointIO

__all__ = ["load_from_checkpoint"]

T = TypeVar("T")


def load_from_checkpoint(cls: type[T], path: str | os.PathLike[str], *, map_location: Any = None,
                         allow_pickle: bool = False, config: Config | None = None, **kwargs: Any) -> T:
    """``cls.load_from_checkpoint(path, map_location=map_location, **kwargs)`` (a
    ``LightningModule`` or ``LightningDataModule`` class) for a checkpoint saved through
    ``GpusnapCheckpointIO``: the newest one committed for ``path``. Other files load as
    Lightning would load them. The process's random generators are left alone.
    ``allow_pickle``: hyper-parameters that hold objects (Lightning then reads them with
    ``weights_only=False``, unless ``kwargs`` say otherwise).

    >>> model = load_from_checkpoint(MyModule, "checkpoints/last.ckpt")   # doctest: +SKIP
    """
    checkpoint = GpusnapCheckpointIO(rng=False, allow_pickle=allow_pickle, config=config).load_checkpoint(path)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    if allow_pickle:
        kwargs.setdefault("weights_only", False)
    return cls.load_from_checkpoint(buffer, map_location=map_location, **kwargs)  # type: ignore[attr-defined]
