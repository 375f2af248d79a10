"""The device chunk hash: its definition (a pure-Python reference), its sensitivity to the
changes that validation and dirty tracking must see, and Triton == torch == CPU."""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from gpusnap.kernels import chunk_hash as ch
from gpusnap.kernels.chunk_hash import chunk_hashes, hashes_to_hex

M32, M64 = (1 << 32) - 1, (1 << 64) - 1


# -- the definition, written out slowly ---------------------------------------------------


def _s32(v: int) -> int:
    v &= M32
    return v - (1 << 32) if v >> 31 else v


def _fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * ch._F1) & M64
    x ^= x >> 33
    x = (x * ch._F2) & M64
    return x ^ (x >> 33)


def reference(data: bytes, chunk_size: int, period: int = ch.PERIOD_PAIRS) -> list[tuple]:
    """The module docstring's definition in plain integers (slow: small inputs only)."""
    rows = []
    for c0 in range(0, len(data), chunk_size):
        chunk = data[c0 : c0 + chunk_size]
        padded = chunk + bytes(-len(chunk) % 8)
        sums = [0, 0, 0, 0]
        for p in range(len(padded) // 8):
            a = int.from_bytes(padded[8 * p : 8 * p + 4], "little", signed=True)
            b = int.from_bytes(padded[8 * p + 4 : 8 * p + 8], "little", signed=True)
            q, k = p % period, p // period
            u = (q * ch._G1) & M32
            u ^= u >> 16
            u = (u * ch._G2) & M32
            u ^= u >> 13
            for j in range(4):
                ka = _s32(u * ch._MA[j] + ch._SA[j])
                kb = _s32(u * ch._MB[j] + ch._SB[j])
                w = _fmix64((k * ch._WM[j] + ch._WA[j]) & M64) | 1
                sums[j] = (sums[j] + w * (a ^ ka) * (b ^ kb)) & M64
        length = len(chunk)
        h0 = _fmix64(_fmix64((sums[0] + length * ch._LC[0]) & M64) ^ sums[1])
        h1 = _fmix64(_fmix64((sums[2] + length * ch._LC[1]) & M64) ^ sums[3])
        rows.append((h0, h1))
    return rows


def unsigned_rows(h: torch.Tensor) -> list[tuple]:
    return [tuple(v & M64 for v in row) for row in h.cpu().tolist()]


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(
        0, dtype=torch.uint8
    )


def random_bytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.fixture
def small_period(monkeypatch: pytest.MonkeyPatch) -> int:
    """A 4-pair key period, so that chunks of a few hundred bytes span several periods."""
    monkeypatch.setattr(ch, "PERIOD_PAIRS", 4)
    return 4


# -- the implementation computes the definition -------------------------------------------


@pytest.mark.parametrize("chunk_size", [16, 48, 64, 4096])
@pytest.mark.parametrize("n", [1, 3, 4, 7, 8, 9, 15, 16, 17, 63, 64, 65, 200, 4099])
def test_torch_matches_reference(n: int, chunk_size: int) -> None:
    data = random_bytes(n, seed=n * 31 + chunk_size)
    assert unsigned_rows(chunk_hashes(as_tensor(data), chunk_size)) == reference(data, chunk_size)


@pytest.mark.parametrize("word", [0x80000000, 0x7FFFFFFF, 0xFFFFFFFF, 0x00000001, 0])
def test_extreme_words_wrap_like_the_reference(word: int) -> None:
    """Products near 2**62 and lane sums that overflow int64 many times over."""
    data = word.to_bytes(4, "little") * 2048  # 8 KiB: 1024 pairs per chunk
    got = unsigned_rows(chunk_hashes(as_tensor(data), 8192))
    assert got == reference(data, 8192)


@pytest.mark.parametrize("chunk_size", [32, 48, 96])
def test_several_periods_match_reference(small_period: int, chunk_size: int) -> None:
    data = random_bytes(5 * chunk_size + 11, seed=chunk_size)
    got = unsigned_rows(chunk_hashes(as_tensor(data), chunk_size))
    assert got == reference(data, chunk_size, period=small_period)


GOLDEN = ["e4ac72f35576791a347ad6e8688e007d", "3bb13cd1c66abe49e161b3edfd8c299f"]


def test_golden_value() -> None:
    """Pins the definition: hashes stored by earlier checkpoints must keep their meaning."""
    data = bytes(range(256)) * 3 + b"tail"
    assert hashes_to_hex(chunk_hashes(as_tensor(data), 512)) == GOLDEN
    assert [f"{h0:016x}{h1:016x}" for h0, h1 in reference(data, 512)] == GOLDEN


# -- shape, device, inputs ----------------------------------------------------------------


def test_shape_dtype_and_empty_input() -> None:
    h = chunk_hashes(torch.zeros(100, dtype=torch.uint8), 16)
    assert h.shape == (7, 2) and h.dtype == torch.int64
    assert chunk_hashes(torch.empty(0, dtype=torch.uint8), 16).shape == (0, 2)
    assert ch.num_chunks(100, 16) == 7 and ch.num_chunks(0, 16) == 0


def test_deterministic_and_out_argument() -> None:
    data = as_tensor(random_bytes(10_000))
    first = chunk_hashes(data, 1024)
    out = torch.full((10, 2), 7, dtype=torch.int64)
    assert chunk_hashes(data, 1024, out=out) is out
    assert torch.equal(first, out) and torch.equal(first, chunk_hashes(data.clone(), 1024))


@pytest.mark.parametrize("offset", [0, 1, 3, 8, 16, 37])
def test_view_equals_copy(offset: int) -> None:
    base = as_tensor(random_bytes(5000, seed=offset))
    view = base[offset : offset + 3000]
    assert torch.equal(chunk_hashes(view, 256), chunk_hashes(view.clone(), 256))


def test_bad_inputs_say_how_to_fix() -> None:
    data = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(TypeError, match="uint8"):
        chunk_hashes(torch.zeros(16, dtype=torch.float32), 16)
    with pytest.raises(TypeError, match="1-D"):
        chunk_hashes(data.view(8, 8), 16)
    with pytest.raises(ValueError, match="contiguous"):
        chunk_hashes(data[::2], 16)
    for bad in (0, 8, 24, -16, 16.0, True):
        with pytest.raises(ValueError, match="multiple of 16"):
            chunk_hashes(data, bad)
    with pytest.raises(ValueError, match=r"shape \(4, 2\)"):
        chunk_hashes(data, 16, out=torch.empty(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="impl"):
        chunk_hashes(data, 16, impl="numpy")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            chunk_hashes(data, 16, impl="triton")


def test_hex() -> None:
    h = torch.tensor([[-1, 0], [1, 2**62]], dtype=torch.int64)
    assert hashes_to_hex(h) == [
        "ffffffffffffffff0000000000000000",
        "00000000000000014000000000000000",
    ]


# -- sensitivity: what validation and dirty tracking must see -----------------------------


def changed_rows(before: torch.Tensor, after: torch.Tensor) -> list[int]:
    return (before != after).any(dim=1).nonzero().flatten().tolist()


def test_every_bit_flip_of_a_small_buffer_changes_exactly_its_chunk() -> None:
    data = as_tensor(random_bytes(16 * 4 + 5))  # 4 full chunks and a 5-byte tail chunk
    base = chunk_hashes(data, 16)
    for pos in range(data.numel()):
        for bit in range(8):
            flipped = data.clone()
            flipped[pos] ^= 1 << bit
            assert changed_rows(base, chunk_hashes(flipped, 16)) == [pos // 16], (pos, bit)


@pytest.mark.parametrize("chunk_size", [4096, 1 << 20])
def test_bit_flips_at_chunk_edges_and_tail(chunk_size: int) -> None:
    n = 3 * chunk_size + 13
    data = as_tensor(random_bytes(n, seed=chunk_size))
    base = chunk_hashes(data, chunk_size)
    rng = random.Random(1)
    edges = [c * chunk_size + d for c in range(3) for d in (0, 1, 3, 4, 7, 8, chunk_size - 1)]
    positions = edges + list(range(n - 13, n)) + [rng.randrange(n) for _ in range(40)]
    for pos in positions:
        bit = rng.randrange(8)
        flipped = data.clone()
        flipped[pos] ^= 1 << bit
        assert changed_rows(base, chunk_hashes(flipped, chunk_size)) == [pos // chunk_size]


def test_zero_chunk_vs_one_nonzero_byte_and_lengths() -> None:
    zeros = torch.zeros(4096, dtype=torch.uint8)
    base = chunk_hashes(zeros, 4096)
    for pos in (0, 1, 2047, 4095):
        one = zeros.clone()
        one[pos] = 1
        assert changed_rows(base, chunk_hashes(one, 4096)) == [0]
    # trailing zeros vs a shorter input: same padded pairs, different length
    seen = {tuple(chunk_hashes(torch.zeros(n, dtype=torch.uint8), 4096)[-1].tolist())
            for n in range(1, 40)}
    assert len(seen) == 39
    data = as_tensor(random_bytes(1000))
    padded = torch.cat([data, torch.zeros(3, dtype=torch.uint8)])
    assert changed_rows(chunk_hashes(data, 1008), chunk_hashes(padded, 1008)) == [0]


def test_word_permutations_change_the_hash() -> None:
    words = torch.arange(1, 1025, dtype=torch.int32)  # distinct words, one 4 KiB chunk
    base = chunk_hashes(words.view(torch.uint8), 4096)
    far = words.clone()
    far[5], far[900] = words[900], words[5]
    permuted = {
        "swap within a pair": torch.cat([words[[1, 0]], words[2:]]),
        "swap across pairs": torch.cat([words[[2, 1, 0]], words[3:]]),
        "swap far words": far,
        "rotate all by one word": torch.roll(words, 1),
        "rotate all by one pair": torch.roll(words, 2),
        "reverse": torch.flip(words, [0]),
    }
    for name, w in permuted.items():
        assert changed_rows(base, chunk_hashes(w.view(torch.uint8), 4096)) == [0], name


def test_structured_changes_of_float_data() -> None:
    """Sign flips, one-ulp nudges, swaps and moves of float32 values: all seen."""
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))  # 256 KiB
    base = chunk_hashes(x.view(torch.uint8), 1 << 16)
    rng = random.Random(2)
    for trial in range(60):
        y = x.clone()
        i, j = rng.sample(range(x.numel()), 2)
        kind = trial % 6
        if kind == 0:
            y[i], y[j] = -x[i], -x[j]  # two sign flips
        elif kind == 1:
            y[i] = torch.nextafter(x[i], torch.tensor(float("inf")))
        elif kind == 2:
            y[i], y[j] = x[j], x[i]
        elif kind == 3:
            y = -x  # whole tensor negated
        elif kind == 4:
            y[i] = 0.0
        else:
            y[i : i + 100] = x[i + 1 : i + 101].clone() if i + 101 <= x.numel() else -x[i : i + 100]
        expected = sorted({p * 4 // (1 << 16) for p in (y != x).nonzero().flatten().tolist()})
        assert changed_rows(base, chunk_hashes(y.view(torch.uint8), 1 << 16)) == expected


def test_no_collisions_among_many_small_chunks() -> None:
    random_data = as_tensor(random_bytes(16 * 100_000, seed=5))
    assert chunk_hashes(random_data, 16).unique(dim=0).shape[0] == 100_000
    # structured data: one counter word per 64-byte chunk, the rest zero
    counter = torch.zeros(100_000, 16, dtype=torch.int32)
    counter[:, 3] = torch.arange(100_000, dtype=torch.int32)
    assert chunk_hashes(counter.view(-1).view(torch.uint8), 64).unique(dim=0).shape[0] == 100_000
    # the same counter moved to every word position of equal all-zero chunks
    moved = torch.zeros(16, 16, dtype=torch.int32)
    moved[torch.arange(16), torch.arange(16)] = 12345
    assert chunk_hashes(moved.view(-1).view(torch.uint8), 64).unique(dim=0).shape[0] == 16


def test_lane_keys_differ_for_every_position() -> None:
    """The property behind 'one changed word is seen by at least three lanes'."""
    ka, kb = ch._key_table(torch.device("cpu"))
    for keys in (ka, kb):
        for j in range(4):
            for k in range(j + 1, 4):
                assert not torch.any(keys[j] == keys[k])
    assert all(m % 4 == 1 for m in ch._MA + ch._MB)
    assert [s % 4 for s in ch._SA] == [0, 1, 2, 3] == [s % 4 for s in ch._SB]


# -- Triton == torch ----------------------------------------------------------------------

CASES = [(1, 16), (17, 16), (100_003, 16), (100_000, 48), (1 << 20, 4096), (3 << 20, 1 << 20),
         ((5 << 20) + 7, 1 << 20), ((3 << 20) + 5, (1 << 20) + 16), (9 << 20, 4 << 20)]


@pytest.mark.cuda
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.parametrize(("n", "chunk_size"), CASES)
def test_triton_equals_torch_on_cuda_and_cpu(n: int, chunk_size: int) -> None:
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    data[:: max(1, n // 97)] = 0xFF
    chunk_hashes(data, chunk_size, impl="torch")  # builds the cached key table once
    torch.cuda.set_sync_debug_mode("error")  # neither path may make the host wait
    try:
        triton_h = chunk_hashes(data, chunk_size, impl="triton")
        torch_h = chunk_hashes(data, chunk_size, impl="torch")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu_h = chunk_hashes(data.cpu(), chunk_size)
    assert torch.equal(triton_h, torch_h) and torch.equal(triton_h.cpu(), cpu_h)


@pytest.mark.cuda
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_triton_several_periods_and_configs(small_period: int) -> None:
    data = torch.randint(0, 256, ((1 << 16) + 13,), dtype=torch.uint8, device="cuda")
    expected = chunk_hashes(data.cpu(), 4096)
    for config in (ch.TritonConfig(256, 4), ch.TritonConfig(2048, 8, prefetch=False),
                   ch.TritonConfig(1024, 4)):
        got = torch.empty_like(expected, device="cuda")
        ch._hash_triton(data, 4096, got, config)
        assert torch.equal(got.cpu(), expected), config


@pytest.mark.cuda
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_triton_offsets_past_2_gib() -> None:
    """Byte offsets beyond int32 (Triton passes small integer arguments as int32)."""
    n, chunk = (2 << 30) + 12345, 4 << 20
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    triton_h = chunk_hashes(data, chunk, impl="triton")
    assert torch.equal(triton_h, chunk_hashes(data, chunk, impl="torch"))
    last = ch.num_chunks(n, chunk) - 2
    assert torch.equal(triton_h[last:].cpu(), chunk_hashes(data[last * chunk :].cpu(), chunk))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the compiled kernels are tested instead")
def test_triton_interpreter_equals_torch() -> None:
    """Triton's CPU interpreter runs the kernels where no GPU is (a separate process: the
    interpreter is chosen by an environment variable read at import). Seen to work with
    Triton 3.9; 3.6's interpreter fails on loop bounds computed from kernel arguments."""
    script = textwrap.dedent(
        """
        import torch
        from gpusnap.kernels import chunk_hash as ch
        cases = [(1, 16), (77, 16), (1000, 48), (4099, 4096), (70_001, 16_400)]
        runs = [(1 << 16, (256, 4, True)), (1 << 16, (1024, 4, False)),
                (4, (256, 4, True)), (4, (16, 1, False))]
        for period, config in runs:
            ch.PERIOD_PAIRS = period  # small periods: several per chunk, with tiny inputs
            for n, cs in cases if period > 4 else cases[:3] + [(700, 96)]:
                d = torch.randint(0, 256, (n,), dtype=torch.uint8)
                want = ch.chunk_hashes(d, cs)
                got = torch.empty_like(want)
                ch._hash_triton(d, cs, got, ch.TritonConfig(*config))
                assert torch.equal(got, want), (n, cs, period, config)
        print("interpreter ok")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=240, check=False)
    assert "interpreter ok" in done.stdout, done.stderr[-3000:]
