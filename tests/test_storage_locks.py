"""The root lock: saves share it, gc needs it alone (two Repository objects, one root)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from faults import any_root, chunks_of, commit_checkpoint, small_config

from gpusnap.errors import StorageError
from gpusnap.storage import Repository


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with any_root(request.param, tmp_path) as r:
        Repository.open(r, create=True)
        yield r


def test_gc_is_skipped_while_a_txn_holds_the_shared_lock(root: str) -> None:
    writer = Repository.open(root, config=small_config())
    other = Repository.open(root, config=small_config())
    commit_checkpoint(writer, [chunks_of(1, 2)])
    txn = writer.begin_write()
    try:
        report = other.gc(keep_last=0, blocking=False)
        assert report.skipped and report.deleted_checkpoints == ()
        assert "gc or save in progress" in report.notes[0]
        with pytest.raises(StorageError, match="gc or save in progress"):
            other.gc(keep_last=0, timeout=0.05)
        assert len(other.list()) == 1
        with pytest.raises(StorageError, match="another writer holds"):
            other.begin_write(timeout=0.05)  # one writer per root: the writer lease refuses a second
    finally:
        txn.abort()
    assert other.gc(keep_last=0, blocking=False).deleted_checkpoints


def test_begin_write_waits_for_gc_then_times_out(root: str) -> None:
    repo = Repository.open(root, config=small_config())
    held = Repository.open(root).backend.lock(exclusive=True, timeout=0)
    try:
        with pytest.raises(StorageError, match="another process holds .*gc or save in progress"):
            repo.begin_write(timeout=0.05)
    finally:
        held.release()
    repo.begin_write(timeout=0.05).abort()
