"""``gpusnap.export``: one checkpoint (or some of its keys) written as a safetensors file, a
``torch.save`` file or a DCP directory, under dotted names (:mod:`gpusnap.interop.names`).

Call order::

    Repository.resolve(checkpoint)        # which checkpoint: its id, fixed from here on
    gpusnap.load(root, id, keys=keys)     # the selected entries, every chunk verified (progress: bytes read)
    names.dotted_names(state)             # name -> tensor or plain value
    atomic.staged(path): writer(names)    # to a temporary name, then renamed into place
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gpusnap.config import Config
from gpusnap.interop import dcp_format, st_format, torch_format
from gpusnap.interop.atomic import staged
from gpusnap.interop.names import dotted_names, selected
from gpusnap.interop.report import ExportReport, Written
from gpusnap.restore.key_select import Selector, normalize
from gpusnap.restore.template_free import load_reporting
from gpusnap.storage.repository import Repository

__all__ = ["FORMATS", "export"]

_WRITERS: dict[str, tuple[Callable[[dict[str, Any], str], Written], bool]] = {
    "safetensors": (st_format.write, False),  # (writer, writes a directory)
    "torch": (torch_format.write, False),
    "dcp": (dcp_format.write, True),
}
FORMATS = tuple(_WRITERS)


def export(
    root: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    format: str,
    checkpoint: str | None = None,
    keys: Sequence[Selector] | str | None = None,
    full_names: bool = False,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    config: Config | None = None,
    progress: Callable[[int], Callable[[int], None]] | None = None,
) -> ExportReport:
    """Write checkpoint ``checkpoint`` (id, tag, or None for the newest) of ``root`` to the
    local ``path`` in ``format``: ``"safetensors"`` (a file; ``pip install safetensors``),
    ``"torch"`` (a ``torch.save`` file) or ``"dcp"`` (a directory for
    ``torch.distributed.checkpoint.load``).

    Names are dotted key paths, as a state_dict's (``model.layer.weight``,
    ``optim.state.0.exp_avg``); ``keys`` selects entries as :func:`gpusnap.load` does. When
    ``keys`` is one selector naming a dict, module or Stateful entry (``keys=["model"]``),
    names are relative to it (``layer.weight``: what ``model.state_dict()`` names, so that
    ``model.load_state_dict(...)`` takes the file and ``gpusnap.import_(..., key="model")``
    takes it back), unless ``full_names``.
    Plain values are written where the format holds them (torch, DCP); safetensors skips
    them. Tensors sharing a storage (tied weights, views) keep sharing in the torch format
    and are written as copies of their own in the others. Both are listed in the report.

    Nothing is left at ``path`` unless the whole export succeeds (an existing ``path`` is a
    FileExistsError unless ``overwrite``). Errors: :class:`~gpusnap.interop.FormatError`
    (a name or dtype the format cannot take, a missing package), ``IntegrityError`` (a
    corrupt checkpoint), and those of :func:`gpusnap.load`.

    ``progress``, for a progress bar over reading the checkpoint (every chunk read and
    verified; the writing that follows is the format library's one call): called once, when
    the selected entries are known, with their stored bytes; it returns a callable that is
    then called with byte counts as chunks are read, summing to that total
    (``progress=lambda total: tqdm(total=total, unit="B").update``).

    >>> import tempfile, os, torch, gpusnap
    >>> from safetensors.torch import load_file
    >>> root, out = tempfile.mkdtemp(), tempfile.mkdtemp()
    >>> model = torch.nn.Linear(4, 2)
    >>> with gpusnap.Checkpointer(root) as ckpt:
    ...     _ = ckpt.save({"model": model, "step": 3}, blocking=True)
    >>> report = gpusnap.export(root, os.path.join(out, "model.safetensors"), format="safetensors",
    ...                         keys=["model"])
    >>> sorted(load_file(os.path.join(out, "model.safetensors")))
    ['bias', 'weight']
    >>> report = gpusnap.export(root, os.path.join(out, "all.pt"), format="torch")
    >>> sorted(torch.load(os.path.join(out, "all.pt"), weights_only=True))
    ['model.bias', 'model.weight', 'step']
    """
    if format not in _WRITERS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    writer, directory = _WRITERS[format]
    if format == "safetensors":
        st_format.library(os.fspath(path))  # a missing package is said before anything is read
    repo = Repository.open(root, storage_options=storage_options, config=config)
    try:
        ident = repo.resolve(checkpoint).id
    finally:
        repo.close()
    chosen = normalize(keys)
    state = load_reporting(root, ident, keys=chosen, storage_options=storage_options, config=config,
                           progress=progress)
    entry = selected(state, chosen[0]) if chosen is not None and len(chosen) == 1 and not full_names else None
    names = dotted_names(entry if isinstance(entry, dict) else state)
    if format == "safetensors":
        st_format.check(names, os.fspath(path))
    try:
        with staged(path, directory=directory, overwrite=overwrite) as tmp:
            written = writer(names, tmp)
    except OSError as exc:
        if isinstance(exc, FileExistsError) or exc.errno is None:
            raise
        raise OSError(exc.errno, f"writing {os.fspath(path)} failed, nothing was left there: {exc.strerror}") from exc
    tensors = [v for v in names.values() if isinstance(v, torch.Tensor)]
    return ExportReport(
        path=os.fspath(path),
        format=format,
        checkpoint=ident,
        tensors=len(tensors),
        nbytes=sum(t.numel() * t.element_size() for t in tensors),
        values=len(names) - len(tensors) - len(written.skipped),
        skipped=written.skipped,
        copies=written.copies,
    )
