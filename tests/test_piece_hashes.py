"""piece_hashes: many small pieces hashed together on the host give, row by row, what
chunk_hashes gives for each piece alone as one chunk."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpusnap.kernels.chunk_hash import PERIOD_PAIRS, chunk_hashes, piece_hashes

LENGTHS = [1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 4, 4, 8192, 8192, 8191, 65536, 65537,
           PERIOD_PAIRS * 8 - 1, PERIOD_PAIRS * 8 + 24]  # (the last two: one period, and past it)


def _alone(piece: bytes) -> torch.Tensor:
    data = torch.frombuffer(bytearray(piece), dtype=torch.uint8)
    return chunk_hashes(data, -(-len(piece) // 16) * 16)[0]


def test_each_row_is_the_hash_of_its_piece_alone() -> None:
    rng = np.random.default_rng(0)
    lengths = LENGTHS + [int(n) for n in rng.integers(1, 70_000, 30)]
    pieces = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in lengths]
    got = piece_hashes([memoryview(p) for p in pieces])
    assert got.shape == (len(pieces), 2)
    for i, piece in enumerate(pieces):
        assert torch.equal(got[i], _alone(piece)), (i, len(piece))


def test_pieces_that_differ_only_in_length_or_one_byte_hash_apart() -> None:
    zeros = [bytes(8), bytes(7), bytes(16)]
    flipped = bytearray(8192)
    flipped[4097] = 1
    rows = piece_hashes(zeros + [bytes(8192), bytes(flipped)])
    assert len({tuple(r.tolist()) for r in rows}) == 5


def test_no_pieces_and_an_empty_piece() -> None:
    assert piece_hashes([]).shape == (0, 2)
    with pytest.raises(ValueError, match="empty"):
        piece_hashes([b"abc", b""])
