"""The ``torch.distributed.checkpoint`` (DCP) format: a directory of ``.distcp`` files and a
``.metadata`` file, written and read in this one process (no process group).

Reading is safe by default, as restore is: DCP's reader unpickles ``.metadata`` with plain
``pickle`` and its planner loads non-tensor values with ``torch.load(weights_only=False)``;
here the metadata goes through an unpickler that admits only DCP's metadata classes, torch
dtypes and sizes, and values through ``torch.load(weights_only=True)``. Tensors are read by
DCP itself (with ``weights_only=True``), each file opened through
:mod:`~gpusnap.interop.contained`: a storage path in ``.metadata`` that is absolute or leads
out of the directory (``..``, a link) is refused before any tensor is read.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from gpusnap.interop.contained import inside, opened
from gpusnap.interop.errors import FormatError, reason
from gpusnap.interop.report import Written
from gpusnap.interop.sharing import shared_with

__all__ = ["METADATA", "read", "write"]

METADATA = ".metadata"


@contextmanager
def _single_process() -> Iterator[None]:
    """DCP warns that it assumes one process even when told so (``no_dist=True``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def write(names: dict[str, Any], path: str) -> Written:
    """``dcp.save`` of ``names`` into the empty directory ``path``. DCP stores each tensor on
    its own, so tensors that shared a storage load as distinct ones (reported as copies)."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    with _single_process():
        save(dict(names), storage_writer=FileSystemWriter(path), no_dist=True)
    tensors = {n: v for n, v in names.items() if isinstance(v, torch.Tensor)}
    return Written(copies=tuple(shared_with(tensors).items()))


def read(path: str) -> dict[Any, Any]:
    """The DCP checkpoint in directory ``path``, on CPU: nested as it was saved (DCP's
    ``planner_data``), else by its flat names. FormatError when it cannot be read."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    class Contained(FileSystem):  # (DCP's reader opens each storage path through these two)
        def concat_path(self, where: Any, suffix: str) -> str:
            return suffix  # kept as .metadata names it: opened inside ``path`` only

        @contextmanager
        def create_stream(self, rel: Any, mode: str) -> Iterator[Any]:
            with opened(path, rel, f"{path}: storage file") as stream:
                yield stream

    class Reader(FileSystemReader):
        def __init__(self, where: str) -> None:
            super().__init__(where)
            self.fs = Contained()

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return _safe_metadata(self, path)

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            # (the dict load() was given: with flatten_state_dict=False, fqns are its keys)
            self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    reader = Reader(path)
    meta = reader.read_metadata()
    flat: dict[str, Any] = {}
    for fqn, entry in meta.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            flat[fqn] = torch.empty(entry.size, dtype=entry.properties.dtype)
        elif isinstance(entry, BytesStorageMetadata):
            flat[fqn] = None  # filled by Planner.load_bytes
        else:
            raise FormatError(f"{path}: entry {fqn!r} is a {type(entry).__name__}, which gpusnap cannot import")
    try:
        with _single_process():
            load(flat, storage_reader=reader, planner=Planner(flatten_state_dict=False), no_dist=True)
    except FormatError:
        raise
    except (Exception, CheckpointException) as exc:  # (CheckpointException is a BaseException)
        if isinstance(_first(exc), FormatError):  # (a file DCP opened was refused: that error as it is)
            raise _first(exc) from exc
        raise FormatError(f"{path}: the DCP checkpoint cannot be read (corrupt or truncated?): {_cause(exc)}") from exc
    return _nested(flat, meta.planner_data)


def _cause(exc: BaseException) -> str:
    """What went wrong, in one line: DCP wraps each rank's error (a missing or truncated
    ``.distcp`` file) in a CheckpointException whose text is their tracebacks."""
    exc = _first(exc)
    return f"{type(exc).__name__}: {reason(exc)}"


def _first(exc: BaseException) -> BaseException:
    """The first rank's own error inside DCP's CheckpointException, else ``exc``."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        if isinstance(first, tuple) and first and isinstance(first[0], BaseException):
            return first[0]
    return exc


def _nested(flat: dict[str, Any], paths: Any) -> dict[Any, Any]:
    """``flat`` laid out along DCP's object paths as DCP's own ``set_element`` lays them (a
    str key makes a dict, an int a list), or ``flat`` itself when the paths do not fit."""
    if not isinstance(paths, dict) or set(paths) != set(flat) or not all(_fits(p, len(flat)) for p in paths.values()):
        return flat
    root: dict[Any, Any] = {}
    try:
        for fqn, value in flat.items():
            path = tuple(paths[fqn])
            here: Any = root
            for key, next_key in zip(path, path[1:]):
                here = _child(here, key, {} if type(next_key) is str else [])
            _set(here, path[-1], value)
    except (TypeError, IndexError):  # paths that contradict each other: keep the flat names
        return flat
    return root


def _fits(path: Any, count: int) -> bool:
    """A path of str keys and list indices (bounded: an index beyond the entries is no list)."""
    return isinstance(path, (tuple, list)) and bool(path) and type(path[0]) is str and all(
        type(k) is str or (type(k) is int and 0 <= k < count) for k in path
    )


def _child(container: Any, key: Any, fresh: Any) -> Any:
    if isinstance(container, dict):
        return container.setdefault(key, fresh)
    _extend(container, key)
    if container[key] is None:
        container[key] = fresh
    return container[key]


def _set(container: Any, key: Any, value: Any) -> None:
    if isinstance(container, list):
        _extend(container, key)
    container[key] = value


def _extend(items: list[Any], index: int) -> None:
    items.extend([None] * (index + 1 - len(items)))


# What DCP's .metadata pickles reference (torch 2.4-2.13): its metadata dataclasses and
# enums, the file reader's per-item record, sizes, dtypes, layouts and paths. Nothing else is
# looked up, so unpickling it cannot call anything else.
_ALLOWED = {
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
_ALLOWED_CLASS_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in _ALLOWED_CLASS_MODULES:
            found = super().find_class(module, name)  # (torch's own module, imported already)
            if isinstance(found, type):
                return found
        raise pickle.UnpicklingError(f"it references {module}.{name}, which DCP metadata does not hold")


def _safe_metadata(reader: Any, path: str) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    where = os.path.join(path, METADATA)
    try:
        with opened(path, METADATA, f"{path}: metadata file") as stream:
            meta = _MetadataUnpickler(stream).load()
    except FileNotFoundError as exc:
        raise FormatError(f"{where}: no such file: not a DCP checkpoint directory") from exc
    except FormatError:
        raise
    except Exception as exc:
        raise FormatError(f"{where}: refused or unreadable DCP metadata: {reason(exc)}") from exc
    if not isinstance(meta, Metadata):
        raise FormatError(f"{where}: holds a {type(meta).__name__}, not DCP metadata")
    _check_storage(meta, path, where)
    if getattr(meta, "storage_meta", None) is None:
        meta.storage_meta = StorageMeta()
    meta.storage_meta.load_id = reader.load_id  # as FileSystemReader.read_metadata does
    return meta


def _check_storage(meta: Any, path: str, where: str) -> None:
    """Every storage file ``.metadata`` names lies inside ``path`` (FormatError naming the
    tensor or value whose file does not), checked before any is opened."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    storage = getattr(meta, "storage_data", None)
    if not isinstance(storage, dict):
        raise FormatError(f"{where}: no storage_data of files holding each entry, not DCP metadata")
    for index, info in storage.items():
        fqn = getattr(index, "fqn", index)
        if not isinstance(info, _StorageInfo):
            raise FormatError(f"{where}: the storage of {fqn!r} is a {type(info).__name__}, not a file record")
        inside(path, info.relative_path, f"{where}: entry {fqn!r} stored in")
