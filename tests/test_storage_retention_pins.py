"""Retention never takes chunks a pending save relies on: what it skipped as unchanged since
the previous checkpoint, what it deduplicated against, and its temporary packs are pinned
until it commits."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from faults import CHUNK, chunks_of, commit_checkpoint, small_config, tmp_files

import gpusnap
from gpusnap import Config
from gpusnap.kernels.hashing import chunk_digest
from gpusnap.storage import Manifest, Repository, StorageEntry
from gpusnap.storage.repository import WriteTxn


def _tracked_config() -> Config:
    # the tracked path: every chunk goes through the copier, which skips unchanged ones
    return Config(chunk_size=512, staging_bytes=2048, pack_size=1 << 16, io_threads=2, eager_cpu_bytes=0,
                  cpu_snapshot_bytes=0, eager_device_bytes=0, device_snapshot=False)


def test_a_save_that_skipped_chunks_keeps_them_through_the_previous_saves_retention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A -> B -> A with keep_last=1: the third save starts while the second is committing, so
    it compares with the first and skips every chunk; the second's retention then retires the
    first checkpoint, whose packs hold exactly those chunks."""
    release = threading.Event()
    real_commit = WriteTxn.commit

    def commit(self: WriteTxn, manifest: Manifest) -> None:
        if manifest.tag == "B":
            assert release.wait(60), "the test never released the second commit"
        real_commit(self, manifest)

    monkeypatch.setattr(WriteTxn, "commit", commit)
    t = torch.zeros(2048)
    state = {"t": t}
    with gpusnap.Checkpointer(tmp_path / "ck", keep_last=1, config=_tracked_config()) as ck:
        t.fill_(1.0)
        ck.save(state, tag="A1").wait()
        t.fill_(2.0)
        second = ck.save(state, tag="B")
        t.fill_(1.0)
        third = ck.save(state, tag="A2")  # compares with A1: B is not committed yet
        third.wait_staged()  # every chunk skipped (reused from A1's packs)
        release.set()
        second.wait()  # its retention retires A1 while the third save is pending
        info = third.wait()
        assert info.stats["bytes_skipped"] == t.numel() * 4
        assert [i.tag for i in ck.list()] == ["A2"]
        t.zero_()
        ck.restore(state, "A2")
    assert torch.equal(t, torch.full((2048,), 1.0))
    assert Repository.open(tmp_path / "ck").verify().ok


def test_retention_pins_what_an_open_transaction_reused_deduplicated_and_wrote(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    repo = Repository.open(root, create=True, config=small_config(io_threads=1))
    old_chunks, own = chunks_of(1, 4), chunks_of(3, 2)
    old = commit_checkpoint(repo, [old_chunks], created=1.0)
    commit_checkpoint(repo, [chunks_of(2, 4)], created=2.0)

    txn = repo.begin_write()  # the next save, still writing when the previous one's retention runs
    digests = [chunk_digest(c) for c in old_chunks]
    assert txn.reuse({0: digests[0], 1: digests[1]}) == {0: digests[0], 1: digests[1]}
    assert txn.has_chunk(digests[2])  # deduplicated: it will not be stored again
    for c in own:
        txn.put_chunk(chunk_digest(c), c)
    pending_tmp = tmp_files(root)
    assert pending_tmp

    report = repo.gc(keep_last=1, blocking=False, fresh=False)
    assert not report.skipped and report.deleted_checkpoints == (old.id,)
    assert tmp_files(root) == pending_tmp, "gc deleted an open transaction's temporary packs"

    names = (*digests[:3], *(chunk_digest(c) for c in own))
    txn.commit(Manifest("next", None, 3.0, CHUNK, (StorageEntry(5 * CHUNK, "cpu", names),), {}, {}))
    fresh = Repository.open(root)
    assert fresh.verify().ok
    assert fresh.read_chunk(digests[0]) == old_chunks[0]
    # unpinned now: the pack of the retired checkpoint goes once nothing names its chunks
    fresh.delete("next")
    assert fresh.gc(keep_last=1).deleted_packs


def test_reuse_leaves_out_chunks_a_retention_deleted_before_the_transaction_opened(tmp_path: Path) -> None:
    repo = Repository.open(tmp_path / "ck", create=True, config=small_config(io_threads=1))
    old_chunks = chunks_of(1, 4)
    commit_checkpoint(repo, [old_chunks], created=1.0)
    commit_checkpoint(repo, [chunks_of(2, 4)], created=2.0)
    assert repo.gc(keep_last=1, fresh=False).deleted_packs  # the first checkpoint's pack is gone
    with repo.begin_write() as txn:
        digest = chunk_digest(old_chunks[0])
        assert txn.reuse({0: digest}) == {}  # the caller stores that chunk itself
        assert not txn.has_chunk(digest)
        txn.abort()
