"""An object store's own exceptions (botocore's ClientError, aiohttp's errors: not OSError)
surface as StorageError naming the path, in one line, like a local disk's."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import gpusnap
from gpusnap import Config, StorageError


class ClientError(Exception):
    """Stands in for botocore.exceptions.ClientError (an Exception, not an OSError)."""


class FlakyStore(MemoryFileSystem):
    """fsspec's memory filesystem, whose calls named in ``failing`` raise ClientError."""

    protocol = ("flakymem",)
    failing: set[str] = set()

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str):
            path = path.removeprefix("flakymem://")
        return super()._strip_protocol(path)

    def _fail(self, call: str, path: Any) -> None:
        if call in self.failing:
            raise ClientError(f"An error occurred (ServiceUnavailable) when calling {call}\non {path}: Slow Down")

    def cat_file(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        self._fail("GetObject", path)
        return super().cat_file(path, *args, **kwargs)

    def _open(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        self._fail("PutObject", path)
        return super()._open(path, *args, **kwargs)

    def ls(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        self._fail("ListObjectsV2", path)
        return super().ls(path, *args, **kwargs)

    def mv(self, path1: Any, path2: Any, *args: Any, **kwargs: Any) -> Any:
        self._fail("CopyObject", path2)
        return super().mv(path1, path2, *args, **kwargs)

    def copy(self, path1: Any, path2: Any, *args: Any, **kwargs: Any) -> Any:
        self._fail("CopyObject", path2)
        return super().copy(path1, path2, *args, **kwargs)


@pytest.fixture()
def root() -> Iterator[str]:
    fsspec.register_implementation("flakymem", FlakyStore, clobber=True)
    name = f"gpusnap-test-{uuid.uuid4().hex}"
    FlakyStore.failing = set()
    yield f"flakymem://{name}"
    FlakyStore.failing = set()
    fs = MemoryFileSystem()
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def _config() -> Config:
    return Config(chunk_size=4096, pack_size=64 * 1024, io_threads=2, staging_bytes=4096)


def _one_line_naming(error: BaseException, where: str) -> None:
    text = str(error)
    assert "\n" not in text and where in text and "ClientError" in text, text
    assert isinstance(error.__cause__, OSError) and isinstance(error.__cause__.__cause__, ClientError)


def test_a_failing_commit_is_a_storage_error(root: str) -> None:
    with gpusnap.Checkpointer(root, config=_config()) as ck:
        first = ck.save({"t": torch.ones(1024)}).wait()
        FlakyStore.failing = {"CopyObject"}  # publishing packs and the manifest
        pending = ck.save({"t": torch.full((1024,), 2.0)})
        with pytest.raises(StorageError, match="earlier checkpoints are intact") as info:
            pending.wait()
        _one_line_naming(info.value, root.removeprefix("flakymem://"))
        FlakyStore.failing = set()
        assert [i.id for i in ck.list()] == [first.id]


def test_failing_reads_and_listings_are_storage_errors(root: str) -> None:
    state = {"t": torch.ones(1024)}
    with gpusnap.Checkpointer(root, config=_config()) as ck:
        ck.save(state).wait()
    with gpusnap.Checkpointer(root, config=_config()) as ck:
        FlakyStore.failing = {"ListObjectsV2"}
        with pytest.raises(StorageError, match="opening checkpoint root") as info:
            ck.list()
        _one_line_naming(info.value, root.removeprefix("flakymem://"))
        FlakyStore.failing = set()
        ck.list()
        FlakyStore.failing = {"ListObjectsV2"}
        with pytest.raises(StorageError, match="listing") as info:
            ck.list()
        _one_line_naming(info.value, "manifests")
        FlakyStore.failing = set()
    with gpusnap.Checkpointer(root, config=_config()) as ck:
        ck.list()
        FlakyStore.failing = {"GetObject"}
        with pytest.raises(StorageError) as info:
            ck.restore(state)
        _one_line_naming(info.value, root.removeprefix("flakymem://"))


def test_a_failing_pack_write_is_a_storage_error(root: str) -> None:
    with gpusnap.Checkpointer(root, config=_config()) as ck:
        ck.save({"t": torch.ones(1024)}).wait()
        FlakyStore.failing = {"PutObject"}
        with pytest.raises(StorageError, match="earlier checkpoints are intact") as info:
            ck.save({"t": torch.full((1024,), 3.0)}).wait()
        _one_line_naming(info.value, "tmp/")
