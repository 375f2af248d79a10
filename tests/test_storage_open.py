"""Opening a root: clear errors for missing or foreign directories; create makes the layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from faults import any_root, small_config

from gpusnap.errors import CheckpointError, CheckpointNotFoundError
from gpusnap.storage import FsspecBackend, LocalBackend, Repository, open_backend


def test_missing_root(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match=f"no checkpoint root at {tmp_path / 'nope'}"):
        Repository.open(tmp_path / "nope")
    assert not (tmp_path / "nope").exists()


def test_empty_directory_is_not_found_but_can_be_created(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        Repository.open(tmp_path)
    Repository.open(tmp_path, create=True)
    assert Repository.open(tmp_path).list() == []


def test_foreign_directory_is_refused_even_with_create(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    for create in (False, True):
        with pytest.raises(CheckpointError, match="not a gpusnap checkpoint root") as info:
            Repository.open(tmp_path, create=create)
        assert not isinstance(info.value, CheckpointNotFoundError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_create_makes_the_documented_layout(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b"
    repo = Repository.open(root, create=True, config=small_config())
    assert repo.root == str(root)
    assert json.loads((root / "gpusnap.json").read_text()) == {"format": "gpusnap", "version": 1}
    assert all((root / d).is_dir() for d in ("packs", "manifests", "tmp"))
    assert (root / "lock").is_file()
    Repository.open(root, create=True)  # opening an existing root with create=True is fine


def test_unknown_layout_version_is_refused(tmp_path: Path) -> None:
    Repository.open(tmp_path, create=True)
    (tmp_path / "gpusnap.json").write_text('{"format": "gpusnap", "version": 9}')
    with pytest.raises(CheckpointError, match="version"):
        Repository.open(tmp_path)


def test_open_backend_dispatch(tmp_path: Path) -> None:
    assert isinstance(open_backend(tmp_path), LocalBackend)
    assert isinstance(open_backend(str(tmp_path)), LocalBackend)
    local = open_backend(f"file://{tmp_path}")
    assert isinstance(local, LocalBackend) and local.root == str(tmp_path)
    assert isinstance(open_backend("memory://somewhere"), FsspecBackend)


def test_missing_memory_root(tmp_path: Path) -> None:
    with any_root("memory", tmp_path) as url:
        with pytest.raises(CheckpointNotFoundError, match="no checkpoint root"):
            Repository.open(url)
        Repository.open(url, create=True)
        assert Repository.open(url).list() == []


def test_concurrent_create_of_one_root(tmp_path: Path) -> None:
    import threading

    def opener(root: Path, errors: list[BaseException]) -> None:
        try:
            Repository.open(root, create=True)
        except BaseException as exc:  # reported below
            errors.append(exc)

    for n in range(20):
        root = tmp_path / f"r{n}"
        errors: list[BaseException] = []
        threads = [threading.Thread(target=opener, args=(root, errors)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert Repository.open(root).list() == []
