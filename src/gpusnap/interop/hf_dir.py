"""A Hugging Face model directory, as ``save_pretrained`` writes it: one ``model.safetensors``,
or shards ``model-0000x-of-0000y.safetensors`` named by ``model.safetensors.index.json``
(whose ``weight_map`` says which shard holds each tensor); the ``pytorch_model.bin`` forms
likewise. The index and the shards must agree exactly. Every file is read through
:mod:`~gpusnap.interop.contained`: a shard or index that is (or links to) a file outside the
directory is refused."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch

from gpusnap.interop import st_format, torch_format
from gpusnap.interop.contained import opened, path_of
from gpusnap.interop.errors import FormatError, reason

__all__ = ["FILES", "read"]

_Reader = Callable[[str, str], Any]  # (path to read, path to name in errors)
# (index file, single file, reader), in the order transformers prefers them
_LAYOUTS: tuple[tuple[str, str, _Reader], ...] = (
    ("model.safetensors.index.json", "model.safetensors", st_format.read),
    ("pytorch_model.bin.index.json", "pytorch_model.bin", torch_format.read),
)
FILES = tuple(name for layout in _LAYOUTS for name in layout[:2])
"""The file names that make a directory a Hugging Face model directory."""


def read(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the model directory ``path`` by name, in the index's order."""
    for index, single, reader in _LAYOUTS:
        if os.path.isfile(os.path.join(path, index)):
            return _sharded(path, index, reader)
        if os.path.isfile(os.path.join(path, single)):
            return _tensors(_read(path, single, reader, f"{path}: model file"), os.path.join(path, single))
    raise FormatError(f"{path}: no {' or '.join(FILES)} in it: not a Hugging Face model directory")


def _sharded(path: str, index: str, reader: _Reader) -> dict[str, torch.Tensor]:
    where = os.path.join(path, index)
    weight_map = _weight_map(path, index)
    placed: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise FormatError(f"{where}: shard {shard!r} (for {name!r}) is not a file name in {path}")
        placed.setdefault(shard, []).append(name)
    found: dict[str, torch.Tensor] = {}
    for shard, names in placed.items():
        shard_path = os.path.join(path, shard)
        if not os.path.isfile(shard_path):
            raise FormatError(f"{shard_path}: missing (the index {index} places {len(names)} tensor(s) there)")
        tensors = _tensors(_read(path, shard, reader, f"{where}: shard"), shard_path)
        lacking = [n for n in names if n not in tensors]
        extra = [n for n in tensors if n not in weight_map or weight_map[n] != shard]
        if lacking or extra:
            problem = f"lacks {lacking[:3]} that {index} places there" if lacking else (
                f"holds {extra[:3]} that {index} does not place there")
            raise FormatError(f"{shard_path}: {problem}: the index and its shards disagree")
        found.update(tensors)
    return {name: found[name] for name in weight_map}


def _read(path: str, name: str, reader: _Reader, entry: str) -> Any:
    """What ``reader`` makes of the file ``name`` in ``path``, opened inside ``path`` only."""
    with opened(path, name, entry) as stream:
        return reader(path_of(stream), os.path.join(path, name))


def _weight_map(path: str, index: str) -> dict[str, str]:
    where = os.path.join(path, index)
    try:
        with opened(path, index, f"{path}: index file") as stream:
            doc = json.loads(stream.read().decode("utf-8"))
    except FormatError:
        raise
    except (OSError, ValueError) as exc:
        raise FormatError(f"{where}: not a readable JSON index: {reason(exc)}") from exc
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise FormatError(f"{where}: no \"weight_map\" of tensor names to shard files")
    return weight_map


def _tensors(content: Any, where: str) -> dict[str, torch.Tensor]:
    """``content`` as name -> tensor (a ``pytorch_model.bin`` can hold anything plain)."""
    if not isinstance(content, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                 for k, v in content.items()):
        raise FormatError(f"{where}: not a state_dict (a dict of named tensors)")
    return content
