"""Chunks and manifests written through a transaction read back identically (local and memory://)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from faults import CHUNK, any_root, chunks_of, commit_checkpoint, small_config

from gpusnap.kernels.hashing import chunk_digest
from gpusnap.storage import Manifest, Repository, StorageEntry


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with any_root(request.param, tmp_path) as r:
        yield r


def test_chunks_and_manifest_survive_reopening(root: str) -> None:
    repo = Repository.open(root, create=True, config=small_config())
    spans = [chunks_of(1, 9), chunks_of(2, 2) + [b"tail"]]
    m = commit_checkpoint(repo, spans, tag="first", stats={"stall_s": 0.001})

    again = Repository.open(root, config=small_config())
    (listed,) = again.list()
    assert listed == m
    for span, entry in zip(spans, listed.storages):
        for data, digest in zip(span, entry.chunks):
            assert again.read_chunk(digest, what="model.weight") == data
            buf = bytearray(len(data))
            again.read_chunk_into(digest, memoryview(buf))
            assert bytes(buf) == data
    report = again.verify()
    assert report.ok, report.problems
    assert report.checked_chunks == 12
    assert report.checked_bytes == 11 * CHUNK + 4


def test_small_pack_size_spreads_chunks_over_several_packs(root: str) -> None:
    repo = Repository.open(root, create=True, config=small_config(pack_size=3 * CHUNK, io_threads=1))
    commit_checkpoint(repo, [chunks_of(3, 10)])
    packs = [n for fan in repo.backend.listdir("packs") for n in repo.backend.listdir(f"packs/{fan}")]
    assert len(packs) == 4  # 3 + 3 + 3 + 1


def test_concurrent_puts_from_many_threads(root: str) -> None:
    repo = Repository.open(root, create=True, config=small_config(io_threads=3, pack_size=5 * CHUNK))
    chunks = chunks_of(4, 60)
    digests = [chunk_digest(c) for c in chunks]
    with repo.begin_write() as txn:
        def worker(k: int) -> None:
            for i in range(k, len(chunks), 6):
                txn.put_chunk(digests[i], memoryview(chunks[i]))
                txn.put_chunk(digests[i], chunks[i])  # racing duplicate: stored once

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(txn.has_chunk(d) for d in digests)
        txn.commit(Manifest("c1", None, 1.0, CHUNK, (StorageEntry(60 * CHUNK, "cpu", tuple(digests)),), {}, {}))
    fresh = Repository.open(root, config=small_config())
    assert [fresh.read_chunk(d) for d in digests] == chunks
    assert fresh.verify().ok


def test_non_byte_memoryview_is_stored_by_bytes(root: str) -> None:
    import array

    repo = Repository.open(root, create=True, config=small_config())
    data = array.array("f", [1.5] * 128)  # 512 bytes, itemsize 4
    raw = data.tobytes()
    with repo.begin_write() as txn:
        txn.put_chunk(chunk_digest(raw), memoryview(data))
        txn.commit(Manifest("c1", None, 1.0, CHUNK, (StorageEntry(512, "cpu", (chunk_digest(raw),)),), {}, {}))
    assert repo.read_chunk(chunk_digest(raw)) == raw
