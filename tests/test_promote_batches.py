"""A promotion checks a model's many small chunks together, in one pass, and hands its runs
to the pool a bounded number at a time; both keep every check and the commit's guarantees."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from fast_support import CFG, make_state, roots

import gpusnap
from gpusnap.kernels.chunk_hash import chunk_hashes, hex_rows
from gpusnap.storage import promote as promote_mod
from gpusnap.storage.fast_tier import FastTier, chunk_location, slab_path
from gpusnap.storage.host_bytes_hash import hash_host_bytes, hash_host_pieces
from gpusnap.storage.promote import check_groups, check_runs, is_pieces, promote
from gpusnap.storage.repository import Repository

DEVICES = [None, torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_pieces_hash_as_each_one_alone(device: torch.device | None) -> None:
    gen = torch.Generator().manual_seed(7)
    lengths = [1, 15, 16, 17, 1000, 65536, 65536 + 5, 3]
    pieces = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).numpy() for n in lengths]
    want = [hex_rows(chunk_hashes(torch.from_numpy(p), -(-len(p) // 16) * 16, impl="torch").numpy())[0]
            for p in pieces]
    assert hash_host_pieces([memoryview(p) for p in pieces], device) == want
    assert want == [hash_host_bytes(memoryview(p), -(-len(p) // 16) * 16, device)[0] for p in pieces]
    with pytest.raises(ValueError, match="empty"):
        hash_host_pieces([memoryview(b"")], device)


def _saved(tmp_path: Path, seed: int = 3) -> tuple[Path, Path, FastTier, Any]:
    durable, fast = roots(tmp_path)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        info = ck.save(make_state(seed)).wait()
    tier = FastTier.open(fast)
    return durable, fast, tier, tier.load_manifest(info.id)


def test_small_chunks_are_grouped_in_order_and_runs_stay_groups_of_their_own(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _durable, _fast, _tier, manifest = _saved(tmp_path)
    every = [n for e in manifest.storages for n in e.chunks]
    groups = check_groups(every, CFG.chunk_size)
    assert [n for g in groups for n in g] == every  # every chunk once, in order
    pieces = [g for g in groups if is_pieces(g, CFG.chunk_size)]
    assert pieces and any(len(g) > 1 for g in pieces)  # (the model's biases and the tail of "x" together)
    for g in groups:
        if is_pieces(g, CFG.chunk_size):
            assert all(chunk_location(n)[3] < CFG.chunk_size for n in g)
        else:
            assert check_runs(g, CFG.chunk_size, promote_mod.CHECK_BYTES) == [g]  # one run
    monkeypatch.setattr(promote_mod, "PIECES", 2)
    assert all(len(g) <= 2 for g in check_groups(every, CFG.chunk_size) if is_pieces(g, CFG.chunk_size))
    monkeypatch.setattr(promote_mod, "PIECES", 512)
    monkeypatch.setattr(promote_mod, "PIECES_BYTES", 16)  # (each small chunk then alone)
    assert all(len(g) == 1 for g in check_groups(every, CFG.chunk_size) if is_pieces(g, CFG.chunk_size))


@pytest.mark.parametrize("which", [0, -1])
def test_a_flipped_byte_of_a_small_chunk_checked_with_others_fails_the_promotion_naming_it(
        tmp_path: Path, which: int) -> None:
    durable, fast, tier, manifest = _saved(tmp_path)
    every = [n for e in manifest.storages for n in e.chunks]
    batch = max((g for g in check_groups(every, CFG.chunk_size) if is_pieces(g, CFG.chunk_size)), key=len)
    bad = batch[which]
    _h, slab, offset, n = chunk_location(bad)
    with open(fast / slab_path(slab), "r+b") as f:
        f.seek(offset + n - 1)
        byte = f.read(1)
        f.seek(offset + n - 1)
        f.write(bytes([byte[0] ^ 0x01]))
    repo = Repository.open(durable, create=True, config=CFG)
    try:
        with pytest.raises(gpusnap.IntegrityError, match=bad.split("@")[0]):
            promote(tier, manifest, repo)
    finally:
        repo.close()
    assert Repository.open(durable).list() == []  # never a durable copy of wrong bytes
    with pytest.raises(gpusnap.IntegrityError, match="bytes given"):
        tier.check_pieces([bad], [memoryview(b"x")])


class _CountingPool(ThreadPoolExecutor):
    """A pool that records how many of its futures were not yet done at each submit."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.futures: list[Future[Any]] = []
        self.most_ahead = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.most_ahead = max(self.most_ahead, 1 + sum(not f.done() for f in self.futures))
        future = super().submit(fn, *args, **kwargs)
        self.futures.append(future)
        return future


def test_a_promotion_hands_the_pool_a_bounded_number_of_runs_at_a_time(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    durable, _fast, tier, manifest = _saved(tmp_path)
    runs = [r for g in check_groups([n for e in manifest.storages for n in e.chunks], CFG.chunk_size)
            for r in check_runs(g, CFG.chunk_size)]
    assert len(runs) > 3
    monkeypatch.setattr(promote_mod, "IN_FLIGHT_RUNS", 2)
    pool = _CountingPool(4)
    repo = Repository.open(durable, create=True, config=CFG)
    try:
        promoted = promote(tier, manifest, repo, pool)
    finally:
        pool.shutdown()
        repo.close()
    assert len(pool.futures) == len(runs)  # every run written, each once
    assert pool.most_ahead <= 2
    assert Repository.open(durable).list()[0].id == promoted.id
    assert Repository.open(durable).verify().ok
