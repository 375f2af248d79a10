"""Backend failures (full disk, permission denied, failed rename) never harm committed checkpoints."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from faults import FaultyBackend, chunks_of, commit_checkpoint, small_config, tmp_files

from gpusnap.errors import CheckpointError, StorageError
from gpusnap.storage import LocalBackend, Manifest, Repository


@pytest.fixture()
def setup(tmp_path: Path) -> tuple[Path, FaultyBackend, Repository, Manifest]:
    root = tmp_path / "ck"
    Repository.open(root, create=True)
    backend = FaultyBackend(LocalBackend(root))
    repo = Repository.open(root, backend=backend, config=small_config())
    first = commit_checkpoint(repo, [chunks_of(1, 6)], created=1.0)
    return root, backend, repo, first


def _assert_first_intact(root: Path, first: Manifest) -> None:
    fresh = Repository.open(root, config=small_config())
    assert fresh.list() == [first] and fresh.problems() == []
    assert fresh.read_chunk(first.storages[0].chunks[2]) == chunks_of(1, 6)[2]
    assert fresh.verify().ok
    assert tmp_files(root) == []
    assert not fresh.gc(blocking=False).skipped  # no lock left behind


def test_enospc_during_put_chunk(setup: tuple[Path, FaultyBackend, Repository, Manifest]) -> None:
    root, backend, repo, first = setup
    backend.write_budget = backend.bytes_written + 5 * 512 + 100  # dies inside the second pack
    with pytest.raises(StorageError) as info:
        commit_checkpoint(repo, [chunks_of(2, 12)], created=2.0)
    message = str(info.value)
    assert "No space left on device" in message and "ENOSPC" in message
    assert "earlier checkpoints are intact" in message and str(root / "tmp") in message
    assert "\n" not in message
    backend.write_budget = None
    _assert_first_intact(root, first)
    commit_checkpoint(repo, [chunks_of(3, 3)], created=3.0)  # the repository is still usable
    assert len(repo.list()) == 2


def test_put_after_failure_repeats_the_error(setup: tuple[Path, FaultyBackend, Repository, Manifest]) -> None:
    root, backend, repo, first = setup
    backend.write_budget = backend.bytes_written
    chunks = chunks_of(2, 2)
    with repo.begin_write() as txn:
        with pytest.raises(StorageError):
            txn.put_chunk("a" * 32, chunks[0])
        with pytest.raises(StorageError, match="ENOSPC"):
            txn.put_chunk("b" * 32, chunks[1])
    backend.write_budget = None
    _assert_first_intact(root, first)


@pytest.mark.parametrize("extra", [0, 10, 45])  # in the index, in the footer
def test_enospc_while_commit_finishes_packs(
    setup: tuple[Path, FaultyBackend, Repository, Manifest], extra: int
) -> None:
    root, backend, repo, first = setup
    packs_before = sorted((root / "packs").rglob("*.pack"))
    from gpusnap.kernels.hashing import chunk_digest
    from gpusnap.storage import StorageEntry

    chunks = chunks_of(2, 3)  # fewer than a pack: its trailer is written by commit
    txn = repo.begin_write()
    digests = tuple(chunk_digest(c) for c in chunks)
    for d, c in zip(digests, chunks):
        txn.put_chunk(d, c)
    backend.write_budget = backend.bytes_written + extra
    manifest = Manifest("c2", None, 2.0, 512, (StorageEntry(3 * 512, "cpu", digests),), {}, {})
    with pytest.raises(StorageError, match="No space left"):
        txn.commit(manifest)  # aborts by itself
    backend.write_budget = None
    assert sorted((root / "packs").rglob("*.pack")) == packs_before
    _assert_first_intact(root, first)


def test_enospc_writing_the_manifest(setup: tuple[Path, FaultyBackend, Repository, Manifest]) -> None:
    root, backend, repo, first = setup
    backend.fail_open_write = lambda path: path.endswith(".json")
    with pytest.raises(StorageError, match="writing manifest.*intact"):
        commit_checkpoint(repo, [chunks_of(2, 6)], created=2.0)
    backend.fail_open_write = None
    assert tmp_files(root) == [] and Repository.open(root).list() == [first]
    report = Repository.open(root).gc()  # its packs were already published: garbage for gc
    assert len(report.deleted_packs) == 2 and not report.deleted_checkpoints
    _assert_first_intact(root, first)


def test_failed_manifest_rename(setup: tuple[Path, FaultyBackend, Repository, Manifest]) -> None:
    root, backend, repo, first = setup
    backend.fail_rename = lambda dst: dst.startswith("manifests/")
    with pytest.raises(StorageError, match="EIO"):
        commit_checkpoint(repo, [chunks_of(2, 2)], created=2.0)
    backend.fail_rename = None
    _assert_first_intact(root, first)


def test_eacces_on_read_is_a_clear_storage_error(setup: tuple[Path, FaultyBackend, Repository, Manifest]) -> None:
    root, backend, repo, first = setup
    backend.read_errno = errno.EACCES
    digest = first.storages[0].chunks[0]
    with pytest.raises(StorageError) as info:
        repo.read_chunk(digest, what="model.weight")
    message = str(info.value)
    assert "Permission denied" in message and "model.weight" in message and str(root / "packs") in message
    with pytest.raises(StorageError, match="Permission denied"):
        repo.read_chunk_into(digest, memoryview(bytearray(512)))
    with pytest.raises(StorageError, match="Permission denied"):
        Repository.open(root, backend=backend)  # gpusnap.json cannot be read
    report = repo.verify()
    assert not report.ok and all("Permission denied" in p for p in report.problems)
    backend.read_errno = None
    assert repo.verify().ok


def test_eacces_on_manifest_keeps_gc_from_deleting_packs(
    setup: tuple[Path, FaultyBackend, Repository, Manifest],
) -> None:
    root, backend, _, first = setup
    fresh = Repository.open(root, backend=backend)
    backend.read_errno = errno.EACCES
    with pytest.raises(CheckpointError, match="unreadable"):
        fresh.resolve(None)
    report = fresh.gc(keep_last=0)
    assert report.deleted_packs == () and report.deleted_checkpoints == ()
    backend.read_errno = None
    _assert_first_intact(root, first)
