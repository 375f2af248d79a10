"""An unreadable newest manifest is never passed over in silence: restore() warns and records
the checkpoints it skipped, list()/latest() warn (once per file), the repository says which."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
import torch

import gpusnap
from gpusnap import Config
from gpusnap.storage import LocalBackend, Repository


def _config() -> Config:
    return Config(chunk_size=4096, pack_size=64 * 1024, io_threads=2, staging_bytes=4096)


def _two_checkpoints(root: Path) -> tuple[str, str]:
    t = torch.zeros(1024)
    with gpusnap.Checkpointer(root, config=_config()) as ck:
        t.fill_(1.0)
        old = ck.save({"t": t}, blocking=True).wait().id
        t.fill_(2.0)
        new = ck.save({"t": t}, blocking=True).wait().id
    return old, new


def _warnings(caplog: pytest.LogCaptureFixture, cid: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and cid in r.getMessage()]


def _truncate(root: Path, cid: str) -> None:
    path = root / "manifests" / f"{cid}.json"
    path.write_bytes(path.read_bytes()[:-40])


def test_restore_of_latest_warns_and_records_the_newer_checkpoint_it_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ck"
    old, new = _two_checkpoints(root)
    _truncate(root, new)
    state = {"t": torch.zeros(1024)}
    with caplog.at_level(logging.WARNING, logger="gpusnap"), gpusnap.Checkpointer(root, config=_config()) as ck:
        handle = ck.restore(state)
        assert handle.stats["checkpoint"] == old
        (skipped,) = handle.stats["skipped_newer"]
        assert skipped["id"] == new and skipped["reason"]
        (message,) = _warnings(caplog, new)
        assert "unreadable" in message and old in message and skipped["reason"] in message
        assert torch.equal(state["t"], torch.full((1024,), 1.0))

        # list() and latest() say so too, once per file for this Checkpointer
        caplog.clear()
        assert [i.id for i in ck.list()] == [old]
        assert ck.latest().id == old  # type: ignore[union-attr]
        assert _warnings(caplog, new) == []  # already reported by restore()
    with caplog.at_level(logging.WARNING, logger="gpusnap"), gpusnap.Checkpointer(root, config=_config()) as ck:
        caplog.clear()
        assert ck.latest().id == old  # type: ignore[union-attr]
        ck.list()
        assert len(_warnings(caplog, new)) == 1


def test_a_newest_manifest_that_cannot_be_read_is_named_with_the_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ck"
    old, new = _two_checkpoints(root)
    real = LocalBackend.read_range

    def read_range(self: LocalBackend, path: str, offset: int = 0, length: int | None = None) -> bytes:
        if path == f"manifests/{new}.json":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), self.describe(path))
        return real(self, path, offset, length)

    monkeypatch.setattr(LocalBackend, "read_range", read_range)
    with caplog.at_level(logging.WARNING, logger="gpusnap"), gpusnap.Checkpointer(root, config=_config()) as ck:
        handle = ck.restore({"t": torch.zeros(1024)})
        assert [s["id"] for s in handle.stats["skipped_newer"]] == [new]
        assert "Permission denied" in handle.stats["skipped_newer"][0]["reason"]
        assert "Permission denied" in _warnings(caplog, new)[0]
        with pytest.raises(gpusnap.StorageError, match="Permission denied"):
            ck.restore({"t": torch.zeros(1024)}, new)  # asked for by id: its error, not another one


def test_an_unreadable_older_manifest_is_not_a_skipped_newer_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ck"
    old, new = _two_checkpoints(root)
    _truncate(root, old)
    with caplog.at_level(logging.WARNING, logger="gpusnap"), gpusnap.Checkpointer(root, config=_config()) as ck:
        handle = ck.restore({"t": torch.zeros(1024)})
        assert handle.stats["checkpoint"] == new and handle.stats["skipped_newer"] == []
        assert _warnings(caplog, old) == []
        assert [i.id for i in ck.list()] == [new]
        assert len(_warnings(caplog, old)) == 1  # list() leaves it out: it says so


def test_the_repository_lists_unreadable_manifests_for_ls(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    old, new = _two_checkpoints(root)
    _truncate(root, new)
    repo = Repository.open(root)
    (entry,) = repo.unreadable()
    assert entry.id == new and entry.path.endswith(f"{new}.json") and entry.reason
    assert entry.created is not None and abs(entry.created - repo.load_manifest(old).created) < 60
    assert [(p, r) for p, r in repo.problems()] == [(entry.path, entry.reason)]
    assert [u.id for u in repo.skipped_newer(repo.resolve(None))] == [new]
