"""``GpusnapCheckpointIO``: Lightning's checkpoints through gpusnap, saved while training runs.

Lightning hands ``save_checkpoint`` a dict whose tensors are the live parameters and
optimizer state (``state_dict()`` returns references, not copies) and expects nothing back:
``Checkpointer.save`` captures that dict as it is at the call while training goes on, so
no copy is made on the trainer's thread. Each Lightning path becomes a pointer file
(:mod:`.pointer`) naming a checkpoint in a gpusnap root shared by the paths of a directory,
written once the checkpoint commits (:mod:`.commits`); ``ModelCheckpoint`` keeps seeing files
it can list, link, sort by time and remove. The root records the path of each checkpoint, and
loading a path resolves it from that record (:mod:`.records`): a pointer a crash kept from
being written is not needed.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from gpusnap.checkpointer import Checkpointer
from gpusnap.config import Config
from gpusnap.integrations import roots
from gpusnap.restore.template_free import load
from gpusnap.state.rng import RNGState

from .commits import Commits
from .pointer import Pointer
from .records import resolve_file, tag_for

__all__ = ["GpusnapCheckpointIO", "RNG_KEY", "ROOT_NAME", "resolve"]

RNG_KEY = "gpusnap_rng"
"""The checkpoint key under which the process's random generators are saved (``rng=True``)."""

ROOT_NAME = ".gpusnap"
"""Without ``root``: the gpusnap root of a checkpoint directory, inside it."""

_COMMITS = Commits()  # one for the process: every plug-in sees the saves still pending for a path


class GpusnapCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through gpusnap, concurrently with training.

    ``Trainer(plugins=[GpusnapCheckpointIO()])`` routes ``ModelCheckpoint``,
    ``trainer.save_checkpoint`` and ``fit(ckpt_path=...)`` (a path, ``"last"`` or
    ``"best"``) through it. ``save_checkpoint`` returns once ``Checkpointer.save`` has; the
    file at the path is a small pointer, written when the checkpoint is durable, to a
    checkpoint in ``root`` (default: ``<checkpoint directory>/.gpusnap``, one root per
    directory, so a save stores only the chunks that changed since the previous one). A
    path's first save makes it a link to the manifest its checkpoint will be committed as
    (it exists once that checkpoint does), and the root records the path of
    each checkpoint: after a crash, loading a path (``ckpt_path="last"`` included) gives the
    newest checkpoint committed for it, whether or not its pointer was written. A save that
    fails is raised by the next ``save_checkpoint``, by :meth:`wait`, or by
    :meth:`teardown` (the end of ``fit``).

    ``rng=True`` (default) also saves the process's random generators (torch, CUDA, Python,
    NumPy) under ``"gpusnap_rng"`` and restores them when a checkpoint is loaded, which
    Lightning does not do itself: a resumed ``fit`` then draws the same dropout masks and
    shuffles as the run it continues. ``allow_pickle``: also store values that are not
    tensors or plain values (``hparams`` holding objects); loading them needs it too.
    ``config``: the roots' :class:`gpusnap.Config`.

    Paths are local. Files that are not gpusnap pointers (``torch.save`` checkpoints from
    before) are loaded and removed as ``TorchCheckpointIO`` would.

    >>> import lightning as L                                                   # doctest: +SKIP
    >>> io = GpusnapCheckpointIO()                                              # doctest: +SKIP
    >>> trainer = L.Trainer(plugins=[io], callbacks=[L.pytorch.callbacks.ModelCheckpoint(save_last=True)])  # doctest: +SKIP
    >>> trainer.fit(model, data)                                                # doctest: +SKIP
    >>> trainer.fit(model, data, ckpt_path="last")   # resume exactly           # doctest: +SKIP
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        rng: bool = True,
        allow_pickle: bool = False,
        config: Config | None = None,
    ) -> None:
        super().__init__()
        self.root = None if root is None else _local(root, "root")
        self.rng = rng
        self.allow_pickle = allow_pickle
        self.config = config

    # -- CheckpointIO -------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        """Start saving ``checkpoint`` as it is now; returns while it is written. First raises
        the failure of an earlier save not yet raised."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (got {storage_options!r}); "
                            "configure it with GpusnapCheckpointIO(root=..., config=gpusnap.Config(...))")
        if not isinstance(checkpoint, dict):
            raise TypeError(f"checkpoint must be a dict, got {type(checkpoint).__name__}")
        if self.rng and RNG_KEY in checkpoint:
            raise ValueError(f"the checkpoint already has a key {RNG_KEY!r}, where GpusnapCheckpointIO(rng=True) "
                             "saves the random generators: rename it, or pass rng=False")
        _COMMITS.raise_failure()
        target = _local(path, "path")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        root = self._root_for(target)
        checkpointer = self._checkpointer(root)
        state = dict(checkpoint)  # (the caller's dict stays as it was)
        if self.rng:
            state[RNG_KEY] = RNGState()
        _COMMITS.save(target, checkpointer, lambda: checkpointer.save(state, tag=tag_for(target, root)))

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint at ``path`` as Lightning saved it, tensors on ``map_location`` (a
        device; default CPU: Lightning moves state to the model's device as it loads it):
        the newest one committed for ``path`` (see :func:`resolve`). Waits for a save of
        ``path`` still in flight. With ``rng=True`` the random generators are restored too.
        Nothing is unpickled unless ``allow_pickle`` (and never with ``weights_only=True``)."""
        target = _local(path, "path")
        _COMMITS.wait_for(target)  # a save of it still in flight, made by any plug-in
        try:
            pointer = resolve_file(target, self.config)
        except FileNotFoundError:
            raise FileNotFoundError(f"Checkpoint file not found: {target}") from None
        if pointer is None:  # not ours: a torch.save checkpoint
            extra = {} if map_location is None else {"map_location": map_location}
            return TorchCheckpointIO().load_checkpoint(target, weights_only=weights_only, **extra)
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise TypeError(f"{type(self).__name__}.load_checkpoint takes map_location as a device "
                            f"(str or torch.device), got {type(map_location).__name__}")
        state = load(pointer.root, pointer.checkpoint, device=map_location or "cpu",
                     allow_pickle=self.allow_pickle and weights_only is not True, config=self.config)
        generators = state.pop(RNG_KEY, None)
        if generators is not None and self.rng:
            RNGState().load_state_dict(generators)
        return state

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the file at ``path`` now; the checkpoints recorded for it are deleted from
        its root in the background, each once no other pointer in that directory names it."""
        target = _local(path, "path")
        mine = self._root_for(target)
        _COMMITS.removed(target, lambda root: self._checkpointer(root) if root == mine else None)

    def teardown(self) -> None:
        """End of a ``fit``/``validate``/``test``: wait for every save and pointer, release the
        roots (another process may write them now), then raise the first failure."""
        try:
            _COMMITS.wait()
        finally:
            roots.release(self)

    # -- beyond CheckpointIO --------------------------------------------------------------------
    def wait(self) -> None:
        """Block until every save so far is durable and its path names it; raises the first
        failure not yet raised."""
        _COMMITS.wait()

    def _checkpointer(self, root: str) -> Checkpointer:
        return roots.acquire(root, self, config=self.config, allow_pickle=self.allow_pickle)

    def _root_for(self, path: str) -> str:
        return self.root if self.root is not None else os.path.join(os.path.dirname(path), ROOT_NAME)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(root={self.root!r}, rng={self.rng})"


def _local(path: str | os.PathLike[str], what: str) -> str:
    text = os.fspath(path)
    if not isinstance(text, str) or "://" in text:
        raise ValueError(f"GpusnapCheckpointIO keeps its {what} on the local filesystem; got {text!r}: "
                         "give ModelCheckpoint a local dirpath")
    return os.path.abspath(text)


def resolve(path: str | os.PathLike[str]) -> Pointer | None:
    """The gpusnap root and checkpoint id that a Lightning checkpoint path names (None for a
    file that is not a gpusnap pointer), for ``gpusnap show ROOT ID`` or ``gpusnap.load``:
    the newest checkpoint committed for the path, as the root records it, or else the one the
    file names (a copy of a pointer). A file whose first checkpoint never committed (its link
    dangling, or a placeholder, after a crash) is a :class:`gpusnap.CheckpointNotFoundError`."""
    return resolve_file(_local(path, "path"))
