"""What an entry function is called with, in the pool process that was taken: :class:`Ready`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Ready"]


@dataclass(frozen=True)
class Ready:
    """A pool process's model with every weight of ``checkpoint`` in place, checked.

    ``model``: what the entry's ``build()`` returned, in eval mode (as ``from_pretrained``
    returns a model), on ``device``, already warmed up. ``params``: what ``take(params=...)``
    passed (a port, a request queue's name). ``stats``: how the weights came (the restore's
    ``handle.stats``: ``source`` is ``"server"`` or ``"files"``, ...) and what the process paid
    ahead (``import_s``, ``cuda_s``, ``build_s``, ``warm_up_s``), and ``restore_s``.
    ``asked_at`` and ``loaded_at`` are ``time.perf_counter()`` readings in this process: when
    the take arrived, and when every weight was in place.

    >>> @gpusnap.pool.entry(build=build)              # doctest: +SKIP
    ... def serve(ready: gpusnap.pool.Ready) -> None:
    ...     logits = ready.model(tokens.to(ready.device)).logits
    ...     print(f"weights to first logits: {time.perf_counter() - ready.asked_at:.3f} s")
    """

    model: nn.Module
    device: torch.device
    checkpoint: str
    params: Mapping[str, Any]
    stats: Mapping[str, Any]
    asked_at: float
    loaded_at: float
