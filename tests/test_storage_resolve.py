"""Listing order, lookup by id / tag / latest, and readable sortable ids."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from faults import chunks_of, commit_checkpoint, small_config

from gpusnap.errors import CheckpointError, CheckpointNotFoundError
from gpusnap.storage import Repository


@pytest.fixture()
def repo(tmp_path: Path) -> Repository:
    return Repository.open(tmp_path / "ck", create=True, config=small_config())


def test_list_is_oldest_first_by_created_not_commit_order(repo: Repository) -> None:
    late = commit_checkpoint(repo, [chunks_of(1, 1)], created=300.0)
    early = commit_checkpoint(repo, [chunks_of(2, 1)], created=100.0)
    middle = commit_checkpoint(repo, [chunks_of(3, 1)], created=200.0)
    assert [m.id for m in repo.list()] == [early.id, middle.id, late.id]
    assert [m.id for m in Repository.open(repo.root).list()] == [early.id, middle.id, late.id]


def test_resolve_none_id_and_tag(repo: Repository) -> None:
    a = commit_checkpoint(repo, [chunks_of(1, 1)], created=1.0, tag="best")
    with pytest.raises(CheckpointError, match="tag 'best' already names"):
        commit_checkpoint(repo, [chunks_of(2, 1)], created=2.0, tag="best")  # a tag names one checkpoint
    b = commit_checkpoint(repo, [chunks_of(2, 1)], created=2.0, tag="second")
    c = commit_checkpoint(repo, [chunks_of(3, 1)], created=3.0)
    assert repo.resolve(None) == c
    assert repo.resolve(a.id) == a
    assert repo.resolve("best") == a and repo.resolve("second") == b


def test_unknown_ref_lists_known_ids(repo: Repository) -> None:
    a = commit_checkpoint(repo, [chunks_of(1, 1)])
    with pytest.raises(CheckpointNotFoundError, match=a.id) as info:
        repo.resolve("nope")
    assert "'nope'" in str(info.value)


def test_empty_root_has_no_latest(repo: Repository) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        repo.resolve(None)


def test_new_id_is_readable_sortable_and_unique(repo: Repository) -> None:
    ids = [repo.new_id(1764480061.123) for _ in range(200)]
    assert len(set(ids)) == 200
    assert all(re.fullmatch(r"20251130-052101-123-[0-9a-f]{6}", i) for i in ids)
    assert repo.new_id(1764480061.5) > max(ids[:1]) < repo.new_id(1800000000.0)


def test_delete_removes_only_the_manifest(repo: Repository) -> None:
    a = commit_checkpoint(repo, [chunks_of(1, 2)])
    repo.delete(a.id)
    assert repo.list() == []
    assert repo.read_chunk(a.storages[0].chunks[0])  # packs wait for gc
    with pytest.raises(CheckpointNotFoundError):
        repo.delete(a.id)
