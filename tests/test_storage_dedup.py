"""Content addressing: a chunk already stored is never written again, within or across txns."""

from __future__ import annotations

from pathlib import Path

from faults import CHUNK, FaultyBackend, chunks_of, commit_checkpoint, small_config

from gpusnap.kernels.hashing import chunk_digest
from gpusnap.storage import LocalBackend, Repository


def _pack_files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in (root / "packs").rglob("*.pack")}


def test_second_txn_with_same_chunks_writes_no_pack_bytes(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    Repository.open(root, create=True)
    backend = FaultyBackend(LocalBackend(root))
    repo = Repository.open(root, backend=backend, config=small_config())
    chunks = chunks_of(7, 10)
    commit_checkpoint(repo, [chunks])
    packs_before = _pack_files(root)
    written_before = backend.bytes_written

    second = commit_checkpoint(repo, [chunks])
    manifest_bytes = len(second.to_json())
    assert backend.bytes_written - written_before == manifest_bytes  # the manifest, nothing else
    assert _pack_files(root) == packs_before
    assert len(repo.list()) == 2


def test_dedup_works_from_a_fresh_repository_object(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    chunks = chunks_of(8, 5)
    commit_checkpoint(Repository.open(root, create=True, config=small_config()), [chunks])
    repo = Repository.open(root, config=small_config())  # learns packs from their trailers
    with repo.begin_write() as txn:
        assert all(txn.has_chunk(chunk_digest(c)) for c in chunks)
        assert not any(txn.put_chunk(chunk_digest(c), c) for c in chunks)
        txn.abort()


def test_put_returns_false_for_a_repeat_within_a_txn(tmp_path: Path) -> None:
    repo = Repository.open(tmp_path / "ck", create=True, config=small_config())
    data = b"z" * CHUNK
    with repo.begin_write() as txn:
        assert not txn.has_chunk(chunk_digest(data))
        assert txn.put_chunk(chunk_digest(data), data) is True
        assert txn.has_chunk(chunk_digest(data))
        assert txn.put_chunk(chunk_digest(data), data) is False
        txn.abort()
