"""gpusnap: checkpoint and restore the GPU and CPU state of a running PyTorch program.

>>> import torch, gpusnap
>>> model = torch.nn.Linear(8, 8)
>>> optim = torch.optim.AdamW(model.parameters())
>>> app_state = {"model": model, "optim": optim, "rng": gpusnap.RNGState(), "step": 0}
>>> with gpusnap.Checkpointer("memory://pkg-doctest") as ckpt:
...     info = ckpt.save(app_state).wait()
...     handle = ckpt.restore(app_state)

The public names are imported at their first use (PEP 562), so ``import gpusnap`` costs no
more than the package's own file: a command such as ``gpusnap --help``, or a pool process
that has imported only what it needs, does not pay for torch and every layer up front.
"""

from __future__ import annotations

import importlib
import threading
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_WHERE = {
    "Checkpointer": "gpusnap.checkpointer",
    "Config": "gpusnap.config",
    "CheckpointError": "gpusnap.errors",
    "CheckpointNotFoundError": "gpusnap.errors",
    "IntegrityError": "gpusnap.errors",
    "RestoreMismatchError": "gpusnap.errors",
    "SaveSkipped": "gpusnap.errors",
    "StorageError": "gpusnap.errors",
    "ValidationError": "gpusnap.errors",
    "CheckpointInfo": "gpusnap.handles",
    "PendingSave": "gpusnap.handles",
    "RestoreHandle": "gpusnap.handles",
    "export": "gpusnap.interop",
    "import_": "gpusnap.interop",
    "cold_start": "gpusnap.cold_entry",
    "empty_model": "gpusnap.restore.cold",
    "load": "gpusnap.restore.template_free",
    "serve": "gpusnap.serving",
    "RNGState": "gpusnap.state.rng",
    "suspend": "gpusnap.moving",
}

# subpackages with public names of their own (``gpusnap.pool.Pool``, ``gpusnap.migrate.Source``):
# ``import gpusnap`` alone reaches them, as it reaches the names above
_SUBPACKAGES = ("migrate", "pool")

__all__ = [
    "Checkpointer",
    "CheckpointInfo",
    "Config",
    "PendingSave",
    "RestoreHandle",
    "RNGState",
    "cold_start",
    "empty_model",
    "export",
    "import_",
    "load",
    "serve",
    "suspend",
    "CheckpointError",
    "CheckpointNotFoundError",
    "IntegrityError",
    "RestoreMismatchError",
    "SaveSkipped",
    "StorageError",
    "ValidationError",
    "__version__",
]


# first uses from several threads import one at a time: the layers import each other in
# cycles, and two threads entering a cycle at different modules get an ImportError
# ("partially initialized module") or a _DeadlockError, where ``import gpusnap`` used to
# import everything once under the package's own import lock
_IMPORTING = threading.RLock()


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        with _IMPORTING:
            return importlib.import_module(f"gpusnap.{name}")  # (the import binds it here)
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'gpusnap' has no attribute {name!r}")
    with _IMPORTING:
        value = getattr(importlib.import_module(where), name)
    globals()[name] = value  # (later lookups skip this function)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE) | set(_SUBPACKAGES))


if TYPE_CHECKING:  # what type checkers and IDEs see
    from gpusnap.checkpointer import Checkpointer
    from gpusnap.cold_entry import cold_start
    from gpusnap.config import Config
    from gpusnap.errors import (
        CheckpointError,
        CheckpointNotFoundError,
        IntegrityError,
        RestoreMismatchError,
        SaveSkipped,
        StorageError,
        ValidationError,
    )
    from gpusnap.handles import CheckpointInfo, PendingSave, RestoreHandle
    from gpusnap.interop import export, import_
    from gpusnap.moving import suspend
    from gpusnap.restore.cold import empty_model
    from gpusnap.restore.template_free import load
    from gpusnap.serving import serve
    from gpusnap.state.rng import RNGState
