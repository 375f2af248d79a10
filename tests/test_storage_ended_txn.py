"""A write transaction that has ended (committed or aborted) still answers ``has_chunk``: a
hashing thread that outlives its save may ask it; the answer pins nothing any more."""

from __future__ import annotations

from pathlib import Path

from faults import chunks_of, commit_checkpoint, small_config

from gpusnap.kernels.hashing import chunk_digest
from gpusnap.storage import Repository


def test_has_chunk_on_an_ended_transaction_answers(tmp_path: Path) -> None:
    repo = Repository.open(tmp_path / "ck", create=True, config=small_config(io_threads=1))
    chunks = chunks_of(1, 2)
    commit_checkpoint(repo, [chunks], created=1.0)
    txn = repo.begin_write()
    assert txn.has_chunk(chunk_digest(chunks[1]))
    txn.abort()
    assert txn.has_chunk(chunk_digest(chunks[0]))
    assert not txn.has_chunk(chunk_digest(b"never stored"))
    assert not repo.gc(blocking=False).skipped, "the ended transaction holds nothing"
