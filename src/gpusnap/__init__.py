"""gpusnap: checkpoint and restore the GPU and CPU state of a running PyTorch program.

>>> import torch, gpusnap
>>> model = torch.nn.Linear(8, 8)
>>> optim = torch.optim.AdamW(model.parameters())
>>> app_state = {"model": model, "optim": optim, "rng": gpusnap.RNGState(), "step": 0}
>>> with gpusnap.Checkpointer("memory://pkg-doctest") as ckpt:
...     info = ckpt.save(app_state).wait()
...     handle = ckpt.restore(app_state)
"""

from gpusnap.checkpointer import Checkpointer
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
from gpusnap.cold_entry import cold_start
from gpusnap.restore.cold import empty_model
from gpusnap.restore.template_free import load
from gpusnap.serving import serve
from gpusnap.state.rng import RNGState

__version__ = "0.1.0"

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
    "CheckpointError",
    "CheckpointNotFoundError",
    "IntegrityError",
    "RestoreMismatchError",
    "SaveSkipped",
    "StorageError",
    "ValidationError",
    "__version__",
]
