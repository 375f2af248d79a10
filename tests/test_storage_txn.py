"""Transactions: nothing is visible before commit, and an abort leaves no trace."""

from __future__ import annotations

from pathlib import Path

import pytest
from faults import CHUNK, chunks_of, commit_checkpoint, small_config, tmp_files

from gpusnap.errors import CheckpointError
from gpusnap.kernels.hashing import chunk_digest
from gpusnap.storage import Manifest, Repository, StorageEntry


def _put_all(txn, chunks: list[bytes]) -> tuple[str, ...]:  # type: ignore[no-untyped-def]
    digests = tuple(chunk_digest(c) for c in chunks)
    for d, c in zip(digests, chunks):
        txn.put_chunk(d, c)
    return digests


def _snapshot(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_abort_leaves_nothing_visible(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    repo = Repository.open(root, create=True, config=small_config())
    before = _snapshot(root)
    txn = repo.begin_write()
    _put_all(txn, chunks_of(1, 9))  # more than one pack: some finished, some open
    assert tmp_files(root)  # the data really went somewhere
    txn.abort()
    txn.abort()  # idempotent
    assert _snapshot(root) == before
    assert repo.list() == [] and tmp_files(root) == []
    assert not Repository.open(root).gc().deleted_packs


def test_exception_in_with_block_aborts(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    repo = Repository.open(root, create=True, config=small_config())
    with pytest.raises(RuntimeError, match="boom"):
        with repo.begin_write() as txn:
            _put_all(txn, chunks_of(2, 3))
            raise RuntimeError("boom")
    assert tmp_files(root) == [] and repo.list() == []
    assert not repo.gc(blocking=False).skipped  # the shared lock was released


def test_manifest_becomes_visible_only_at_commit(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    repo = Repository.open(root, create=True, config=small_config())
    with repo.begin_write() as txn:
        digests = _put_all(txn, chunks_of(3, 6))
        assert Repository.open(root).list() == []
        txn.commit(Manifest("c1", None, 1.0, CHUNK, (StorageEntry(6 * CHUNK, "cpu", digests),), {}, {}))
        assert [m.id for m in Repository.open(root).list()] == ["c1"]
    assert tmp_files(root) == []


def test_commit_refuses_unknown_chunks_and_aborts(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    repo = Repository.open(root, create=True, config=small_config())
    txn = repo.begin_write()
    digests = _put_all(txn, chunks_of(4, 2))
    bogus = Manifest("c1", None, 1.0, CHUNK, (StorageEntry(3 * CHUNK, "cpu", (*digests, "0" * 32)),), {}, {})
    with pytest.raises(CheckpointError, match="never stored"):
        txn.commit(bogus)
    assert repo.list() == [] and tmp_files(root) == []
    with pytest.raises(CheckpointError, match="aborted"):
        txn.put_chunk("1" * 32, b"x")


def test_commit_refuses_an_existing_id(tmp_path: Path) -> None:
    repo = Repository.open(tmp_path / "ck", create=True, config=small_config())
    first = commit_checkpoint(repo, [chunks_of(5, 1)])
    with repo.begin_write() as txn:
        with pytest.raises(CheckpointError, match="already exists"):
            txn.commit(first)
    assert repo.list() == [first]


def test_put_after_commit_is_an_error(tmp_path: Path) -> None:
    repo = Repository.open(tmp_path / "ck", create=True, config=small_config())
    with repo.begin_write() as txn:
        txn.commit(Manifest("c1", None, 1.0, CHUNK, (), {}, {}))
        with pytest.raises(CheckpointError, match="committed"):
            txn.put_chunk("2" * 32, b"x")
    assert [m.id for m in repo.list()] == ["c1"]


def _manifest_of(repo: Repository, chunks: list[bytes], digests: list[str]) -> Manifest:
    return Manifest(id=repo.new_id(1.0), tag=None, created=1.0, chunk_size=CHUNK,
                    storages=(StorageEntry(sum(map(len, chunks)), "cpu", tuple(digests)),),
                    tree={"t": "dict", "items": []}, stats={})


def test_a_run_is_stored_with_its_known_and_repeated_chunks_skipped(tmp_path: Path) -> None:
    repo = Repository.open(tmp_path / "ck", create=True, config=small_config())
    chunks = chunks_of(2, 6)
    commit_checkpoint(repo, [[chunks[1], chunks[4]]])  # two of them stored before
    run = [chunks[0], chunks[1], chunks[2], chunks[0], chunks[3], chunks[4], chunks[5]]
    digests = [chunk_digest(c) for c in run]
    with repo.begin_write() as txn:
        assert txn.put_run(digests, b"".join(run), [len(c) for c in run]) == 4  # 0, 2, 3, 5
        assert txn.put_run(digests[:3], b"".join(run[:3]), [len(c) for c in run[:3]]) == 0
        manifest = _manifest_of(repo, run, digests)
        txn.commit(manifest)
    assert repo.verify(manifest.id).ok
    assert [repo.read_chunk(d) for d in digests] == run


def test_a_run_that_does_not_fill_its_bytes_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    repo = Repository.open(tmp_path / "ck", create=True, config=small_config())
    chunks = chunks_of(3, 2)
    with repo.begin_write() as txn:
        with pytest.raises(ValueError, match="does not fill"):
            txn.put_run([chunk_digest(c) for c in chunks], b"".join(chunks), [CHUNK, CHUNK - 1])
        with pytest.raises(ValueError, match="device-hash names"):
            txn.put_run(["nh:" + "0" * 32], chunks[0], [CHUNK])
        assert not txn.has_chunk(chunk_digest(chunks[0]))
