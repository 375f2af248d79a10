"""``gpusnap.import_``: a safetensors file, a Hugging Face model directory, a DCP directory
or a ``torch.save`` file committed to a root as one ordinary checkpoint.

Call order::

    detect.identify(path)                 # what the path holds, from its content
    <format>.read(path)                   # every tensor and value, checked, on CPU
    state.flatten(app_state)              # every entry storable (else an error, root untouched)
    Checkpointer(root).save(app_state)    # the normal save: content-addressed, atomic commit (progress: bytes stored)

Everything is read and checked before the root is opened, so a file that cannot be
imported leaves the root as it was; the commit itself is the save's atomic one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from gpusnap.checkpointer import Checkpointer
from gpusnap.config import Config
from gpusnap.errors import CheckpointError
from gpusnap.handles import CheckpointInfo
from gpusnap.interop import dcp_format, hf_dir, st_format, torch_format
from gpusnap.interop.detect import identify
from gpusnap.interop.errors import FormatError
from gpusnap.save.progress import reporting_progress
from gpusnap.state.flatten import flatten
from gpusnap.state.plain import type_name

__all__ = ["import_"]

_READERS: dict[str, Callable[[str], Any]] = {
    "safetensors": st_format.read,
    "torch": torch_format.read,
    "dcp": dcp_format.read,
    "huggingface": hf_dir.read,
}


def import_(
    path: str | os.PathLike[str],
    root: str | os.PathLike[str],
    *,
    key: str | None = None,
    tag: str | None = None,
    storage_options: dict[str, Any] | None = None,
    config: Config | None = None,
    progress: Callable[[int], Callable[[int], None]] | None = None,
) -> CheckpointInfo:
    """Commit the tensors (and plain values) of the local ``path`` to ``root`` as one
    checkpoint and return its :class:`~gpusnap.CheckpointInfo`. Named ``import_`` because
    ``import`` is a Python keyword (the CLI's ``gpusnap import``).

    ``path``: a safetensors file, a Hugging Face model directory (``model.safetensors``, or
    shards with ``model.safetensors.index.json``; the ``pytorch_model.bin`` forms too), a
    DCP directory, or a ``torch.save`` file, told apart by content. ``torch.save`` files and
    DCP values are read with ``weights_only=True``: nothing in the file can run code.

    ``key``: the top-level key to put everything under (``"model"``), so that
    ``ckpt.restore({"model": module})`` or ``gpusnap.cold_start(build, ckpt, key="model")``
    restore a module from a file of its state_dict. Without it the file's own names (or a
    ``torch.save`` dict's keys, or DCP's top-level keys) are the top-level keys.

    A corrupt, truncated or unsupported input is a :class:`~gpusnap.interop.FormatError`
    naming the file, raised before ``root`` is touched.

    ``progress``, for a progress bar over the commit (every chunk hashed and stored; reading
    ``path`` is the format library's one call): called once, when ``path`` has been read,
    with the bytes of its tensors' storages; it returns a callable that is then called with
    byte counts as chunks are stored, from the save's worker threads one call at a time,
    summing to that total (``progress=lambda total: tqdm(total=total, unit="B").update``).

    >>> import tempfile, os, torch, gpusnap
    >>> from safetensors.torch import save_file
    >>> where, root = tempfile.mkdtemp(), tempfile.mkdtemp()
    >>> source = torch.nn.Linear(4, 2)
    >>> save_file(source.state_dict(), os.path.join(where, "model.safetensors"))
    >>> info = gpusnap.import_(os.path.join(where, "model.safetensors"), root, key="model")
    >>> model = torch.nn.Linear(4, 2)
    >>> with gpusnap.Checkpointer(root) as ckpt:
    ...     _ = ckpt.restore({"model": model}, info.id).wait()
    >>> torch.equal(model.weight, source.weight)
    True
    """
    where = os.fspath(path)
    if key is not None and (not isinstance(key, str) or not key):
        raise ValueError(f"key must be a non-empty string, got {key!r}")
    content = _READERS[identify(where)](where)
    if key is not None:
        app_state: dict[Any, Any] = {key: content}
    elif isinstance(content, Mapping):
        app_state = dict(content)
    else:
        raise FormatError(f"{where}: holds a {type_name(content)}, not a dict of named entries; "
                          "pass key=NAME (--key NAME) to store it under one name")
    try:
        flat = flatten(app_state)  # what save() would refuse, refused before the root is opened
    except CheckpointError as exc:
        raise FormatError(f"{where}: cannot be stored: {exc}") from exc
    raised: list[BaseException] = []  # the progress callback's own error, raised as it is
    reporting: AbstractContextManager[None] = nullcontext()
    if progress is not None:  # (the save flattens the same state: the same spans)
        advance = progress(sum(span.nbytes for span in flat.spans))

        def told(n: int) -> None:
            if raised:  # (the save is failing: the other store tasks tell it no more)
                return
            try:
                advance(n)
            except BaseException as exc:
                raised.append(exc)
                raise

        reporting = reporting_progress(told)
    # bytes from someone else's file keep BLAKE2b names (never the memory tier's device-hash
    # names, which are not collision-resistant: docs/tiers.md, "Threat model")
    direct = dataclasses.replace(config if config is not None else Config.from_env(), memory_tier="off")
    with Checkpointer(root, config=direct, storage_options=storage_options) as ckpt, reporting:
        try:
            return ckpt.save(app_state, tag=tag, blocking=True).wait()
        except CheckpointError:
            if raised:
                raise raised[0] from None
            raise
