"""Fast 128-bit hash of fixed-size chunks of a storage, on the device that holds it.

Used for *change detection*, not for identity: validation hashes every chunk of a buffer at
the consistent point and again after the copy (a difference means a write the tracker did
not see), and dirty tracking compares a chunk's hash with the previous checkpoint's to skip
unchanged chunks. Content addressing and the integrity check on read keep BLAKE2b
(:mod:`gpusnap.kernels.hashing`). On CUDA with Triton the hash is one streaming kernel plus a
tiny finalizer, enqueued on the current stream (the host never waits); elsewhere a torch
implementation computes the same bits: on CPU, on CUDA without Triton, on any device.

Definition (everything below is exactly what both implementations compute):

- The input is a 1-D contiguous uint8 tensor of ``n`` bytes, cut into ``ceil(n / chunk_size)``
  chunks; the last one may be short. A chunk's bytes are zero-padded to a multiple of 8 and
  read as little-endian *pairs* of int32 words ``(a, b)``; ``p`` is the pair's index in its
  chunk, ``q = p mod 2**16`` its place in its *period* and ``k = p div 2**16`` the period.
- Position keys: ``u = xorshift13(xorshift16(q * G1) * G2)`` (32-bit, a bijection of ``q``),
  then for each of 4 lanes ``j``: ``Ka_j = u * MA_j + SA_j`` and ``Kb_j = u * MB_j + SB_j``
  (mod 2**32, read as int32). All ``M`` are 1 mod 4 and ``S_j`` is ``j`` mod 4, so the four
  lanes' keys of one word differ for every ``q``.
- Lane terms: ``T_j = (a ^ Ka_j) * (b ^ Kb_j)``, the exact signed 64-bit product of two int32.
- Lane sums: ``S_j = sum_k W_j(k) * sum_{pairs in period k} T_j`` mod 2**64, where
  ``W_j(k) = fmix64(k * WM_j + WA_j) | 1`` is odd (periods of a big chunk are weighted
  differently, so moving data between periods changes the sum).
- Output, with ``L`` the chunk's true length in bytes: ``h0 = fmix64(fmix64(S_0 + L*LC0) ^ S_1)``
  and ``h1 = fmix64(fmix64(S_2 + L*LC1) ^ S_3)``; a row ``(h0, h1)`` of int64 (128 bits).
  Padding bytes are zero, so trailing zeros and a shorter chunk differ only through ``L``,
  which both words mix in.

This is NH (the inner hash of UMAC, Black et al. 1999) with XOR instead of addition for the
keys, four times with different keys, so the reasons to trust it are NH's:

- A sum of per-pair terms is an order-free reduction: Triton adds tiles in any order and
  torch uses ``.sum()``; both give the same value mod 2**64.
- One changed word always changes every lane sum where its partner word ``x`` differs from
  the lane's key: ``dS = W * (x ^ K) * dB`` with ``|x ^ K| <= 2**31`` and ``0 < |dB| < 2**32``
  is a nonzero product below 2**63, and ``W`` is odd. Since the four keys differ, at most one
  lane can miss it. Single bit flips, sign flips, small float perturbations in one word are
  therefore always seen by the lane sums; only the final 256 -> 128 bit mix could merge two
  different sets of sums (each output word is a bijection of either of its two sums when the
  other is fixed, so that takes a chance collision of both 64-bit words).
- Several changed words collide in a lane only if their product differences cancel mod
  2**64. For NH with random keys that happens with probability <= 2**-32 per lane (the
  bound UMAC proves); our keys are a fixed function of the position, so this is a heuristic
  for non-adversarial data, and the lanes' keys are not independent, only different
  (multiplicatively, with different constants). Swapped or moved words change the keys they
  meet, so permutations are seen like any other change.
- The fixed weak spot of NH is a word equal to its lane key (``a == Ka_j``): its partner is
  then invisible in that lane, which happens with probability 2**-32 per word and lane and is
  covered by the other three lanes.

So the hash is 128 bits with roughly 2**-120 collision odds for a realistic change and no
guarantee at all against someone who crafts data: never use it to decide that two different
checkpoints hold the same bytes (the repository keeps BLAKE2b for that).

Speed: the torch implementation hashes about 1.1 GB/s on one CPU core (measured CPU-only:
x86-64 with AVX-512, torch 2.13, 1 thread, 4 KiB to 16 MiB chunks; 16-byte chunks are ~10x
slower, their per-chunk finalization dominates). The Triton kernel's hot loop is, in its
sm_90 SASS (compiled ahead of time with Triton 3.6 and 3.9), about 9 multiply-add and 8 other
integer instructions per 4-byte word: at 4.8 TB/s of device memory that would use some 65% of both
integer pipes, so it should run near memory speed if enough loads stay in flight (hence the
prefetch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from gpusnap import launch_hooks

try:  # Triton is optional: without it every device uses the torch implementation.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None

__all__ = [
    "DEFAULT_TRITON_CONFIG",
    "HASH_WORDS",
    "PERIOD_PAIRS",
    "TritonConfig",
    "chunk_hashes",
    "hashes_to_hex",
    "hex_rows",
    "num_chunks",
    "piece_hashes",
    "triton_available",
]

HASH_WORDS = 2  # int64 words per chunk hash: 128 bits
PERIOD_PAIRS = 1 << 16  # key period in 8-byte pairs (512 KiB of data); see the definition
_CHUNK_ALIGN = 16  # chunk sizes are multiples of 16 bytes: whole pairs, 16-byte aligned loads

# Constants of the definition. 32-bit multipliers are 1 mod 4 and the lane offsets are j mod
# 4 (lane keys differ); every constant has its top bit set so that Triton types each literal
# as an unsigned integer of the intended width.
_G1, _G2 = 0x9E3779B1, 0x85EBCA6B
_MA = (0xA54FF535, 0xD1B54A35, 0xE7037ED1, 0x8EBC6AF1)
_SA = (0x923F82A4, 0xE9B5DBA5, 0xEFBE4786, 0xB5C0FBCF)
_MB = (0xC2B2AE3D, 0x94D049BD, 0xBF58476D, 0xF1357AED)
_SB = (0xD807AA98, 0xAB1C5ED5, 0xA831C66E, 0x9BDC06A7)
_F1, _F2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53  # murmur3 fmix64
_WM = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93)
_WA = (0xC2B2AE3D27D4EB4F, 0x9E6C63D0676A9A99, 0xA0761D6478BD642F, 0xE7037ED1A0B428DB)
_LC = (0x8EBC6AF09C88C6E3, 0xCBF29CE484222325)

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1


@dataclass(frozen=True)
class TritonConfig:
    """Launch shape of the streaming kernel: pairs per tile, warps per program, and whether a
    thread loads its next tile before hashing the current one (the default is the expected
    best: 64 to 80 registers per thread, about 24 warps per SM, two 16 KiB tiles in flight per
    program)."""

    block_pairs: int = 2048
    num_warps: int = 8
    prefetch: bool = True


DEFAULT_TRITON_CONFIG = TritonConfig()


def triton_available() -> bool:
    """Whether the Triton kernel can be used for CUDA tensors in this process."""
    return triton is not None and torch.cuda.is_available()


def num_chunks(nbytes: int, chunk_size: int) -> int:
    """Number of chunks (and hash rows) for ``nbytes`` bytes; the last chunk may be short."""
    return -(-nbytes // chunk_size)


def chunk_hashes(
    data: torch.Tensor,
    chunk_size: int,
    *,
    out: torch.Tensor | None = None,
    impl: Literal["auto", "torch", "triton"] = "auto",
) -> torch.Tensor:
    """128-bit hashes of the ``chunk_size``-byte chunks of ``data``, on ``data``'s device.

    ``data`` is a 1-D contiguous uint8 tensor (a storage's bytes); ``chunk_size`` is a positive
    multiple of 16. Returns an int64 tensor of shape ``(num_chunks, 2)`` (``out`` if given);
    no input (0 bytes) gives 0 rows. On CUDA the work is enqueued on the current stream and
    the host does not wait; ``impl="auto"`` uses Triton for CUDA tensors when it is
    installed, the torch implementation otherwise. Both give identical bits. Data whose
    start is not 16-byte aligned (a byte slice of a storage) is hashed from an aligned copy.
    """
    _check(data, chunk_size)
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', not {impl!r}")
    if impl == "triton" and (triton is None or not data.is_cuda):
        raise RuntimeError("impl='triton' needs Triton installed and a CUDA tensor")
    rows = num_chunks(data.numel(), chunk_size)
    if out is None:
        out = torch.empty((rows, HASH_WORDS), dtype=torch.int64, device=data.device)
    elif (
        out.shape != (rows, HASH_WORDS)
        or out.dtype != torch.int64
        or out.device != data.device
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous int64 tensor of shape ({rows}, {HASH_WORDS}) on "
            f"{data.device}; got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if rows == 0:
        return out
    if data.data_ptr() % 16 or data.storage_offset() % 16:
        data = data.clone()  # the pair view and 16-byte loads need an aligned start
    if impl == "triton" or (impl == "auto" and data.is_cuda and triton is not None):
        _hash_triton(data, chunk_size, out, DEFAULT_TRITON_CONFIG)
    else:
        _hash_torch(data, chunk_size, out)
    return out


def piece_hashes(pieces: Sequence[bytes | bytearray | memoryview]) -> torch.Tensor:
    """The hash of each of ``pieces`` as one chunk of its own length, on the host: row ``i``
    is ``chunk_hashes(p, c)[0]`` for ``p = pieces[i]`` and any chunk size ``c >= len(p)``.

    Pieces with the same number of 8-byte pairs are hashed together, a row each, in one pass
    of the torch implementation: hundreds of small tensors (a model's norms, an optimizer's
    step counters) cost a few dozen torch calls in all, not a pass each. Meant for small
    pieces (the host hashes ~1 GB/s per core). Returns an int64 tensor ``(len(pieces), 2)``.
    """
    out = torch.empty((len(pieces), HASH_WORDS), dtype=torch.int64)
    by_pairs: dict[int, list[int]] = {}
    for i, piece in enumerate(pieces):
        n = memoryview(piece).nbytes
        if n == 0:
            raise ValueError(f"piece {i} is empty: no chunk to hash")
        by_pairs.setdefault(-(-n // 8), []).append(i)
    for m, rows in by_pairs.items():
        padded = np.zeros((len(rows), m * 8), dtype=np.uint8)  # (zero-padded to whole pairs)
        lengths = np.empty(len(rows), dtype=np.int64)
        for r, i in enumerate(rows):
            data = np.frombuffer(pieces[i], dtype=np.uint8)
            padded[r, : data.size] = data
            lengths[r] = data.size
        x = torch.from_numpy(padded).view(torch.int64)  # (rows, m) pairs
        sums = torch.zeros((4, len(rows)), dtype=torch.int64)
        _accumulate_torch(sums, x, _block_weights_torch(num_chunks(m, PERIOD_PAIRS), x.device))
        _finalize_torch(sums, torch.from_numpy(lengths), out, torch.tensor(rows))
    return out


def hashes_to_hex(hashes: torch.Tensor) -> list[str]:
    """One 32-character hex string per row of :func:`chunk_hashes` (copies to the host)."""
    if hashes.dim() != 2 or hashes.shape[1] != HASH_WORDS or hashes.dtype != torch.int64:
        raise ValueError(f"expected an int64 tensor of shape (n, {HASH_WORDS})")
    return hex_rows(hashes.cpu().numpy())


def hex_rows(rows: np.ndarray) -> list[str]:
    """:func:`hashes_to_hex` of an ``(n, 2)`` int64 array on the host: one NumPy conversion
    and one ``bytes.hex`` for the whole table, not a format call per word. A save converts
    thousands of rows on a thread that competes with the program for the GIL."""
    words = np.ascontiguousarray(rows, dtype=np.int64).view(np.uint64)
    text = words.astype(">u8").tobytes().hex()  # big-endian: each word's hex digits
    step = 16 * HASH_WORDS
    return [text[i : i + step] for i in range(0, len(text), step)]


def _check(data: torch.Tensor, chunk_size: int) -> None:
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
        raise TypeError(
            "data must be a 1-D uint8 tensor; for any tensor t pass "
            "t.reshape(-1).view(torch.uint8) (contiguous t) or its storage's bytes"
        )
    if not data.is_contiguous():
        raise ValueError("data must be contiguous; pass data.contiguous()")
    if (
        isinstance(chunk_size, bool)
        or not isinstance(chunk_size, int)
        or chunk_size <= 0
        or chunk_size % _CHUNK_ALIGN
        or chunk_size > (1 << 34)
    ):
        raise ValueError(
            f"chunk_size must be a positive multiple of {_CHUNK_ALIGN} up to 16 GiB, "
            f"not {chunk_size!r}"
        )


# ----------------------------------------------------------------------------------------
# torch implementation: int64 tensors holding exact values; masks emulate unsigned 32/64-bit
# arithmetic (torch shifts int64 arithmetically), multiplications wrap mod 2**64.


def _s64(v: int) -> int:
    """An unsigned 64-bit constant as the signed value torch's int64 holds."""
    v &= _M64
    return v - (1 << 64) if v >> 63 else v


def _fmix64_torch(x: torch.Tensor) -> torch.Tensor:
    """murmur3's fmix64 in place on ``x`` (in-place: one chunk row per element can be many)."""
    t = torch.empty_like(x)
    for mult in (_F1, _F2, None):
        torch.bitwise_right_shift(x, 33, out=t)
        x ^= t.bitwise_and_((1 << 31) - 1)  # a logical shift: arithmetic, then keep 31 bits
        if mult is not None:
            x *= _s64(mult)
    return x


def _block_weights_torch(periods: int, device: torch.device) -> torch.Tensor:
    """``W_j(k)`` for ``k < periods`` as an int64 tensor of shape (4, periods).

    Built from Python scalars only: no host-to-device copy, so no stall on a busy stream.
    """
    k = torch.arange(periods, dtype=torch.int64, device=device)
    lanes = [k * _s64(m) + _s64(a) for m, a in zip(_WM, _WA)]
    return _fmix64_torch(torch.stack(lanes)) | 1


_KEYS: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _key_table(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sign-extended keys ``Ka``, ``Kb`` of one period, each (4, PERIOD_PAIRS) int64.

    4 MiB per device, built once: cheaper than recomputing keys per block on the CPU.
    """
    table = _KEYS.get((device, PERIOD_PAIRS))
    if table is None:
        q = torch.arange(PERIOD_PAIRS, dtype=torch.int64, device=device)
        u = (q * _G1) & _M32
        u = u ^ (u >> 16)
        u = (u * _G2) & _M32
        u = u ^ (u >> 13)

        def lane_keys(mult: tuple[int, ...], add: tuple[int, ...]) -> torch.Tensor:
            k = torch.stack([(u * m + a) & _M32 for m, a in zip(mult, add)])  # exact: < 2**64
            return k - ((k >> 31) << 32)  # read as int32, sign-extended

        table = (lane_keys(_MA, _SA).contiguous(), lane_keys(_MB, _SB).contiguous())
        _KEYS[(device, PERIOD_PAIRS)] = table
    return table


# Pairs per torch block. CPU: temporaries of 2 x 4 lanes x 8 bytes per pair (2 MiB) stay in
# cache, and per-op dispatch stays small next to the work (best of 8K..64K measured). A GPU
# without Triton wants few, large launches instead (256 MiB of temporaries).
_TORCH_BLOCK_PAIRS_CPU = 1 << 15
_TORCH_BLOCK_PAIRS_DEVICE = 1 << 22
_TORCH_NARROW = 64  # below this many columns per row, reduce across rows instead


def _lane_sums_torch(x: torch.Tensor, q0: int) -> torch.Tensor:
    """Lane sums (4, R) of the pair rows ``x`` (R, m) int64 whose first pair has key index q0."""
    rows, m = x.shape
    ka_all, kb_all = _key_table(x.device)
    acc = torch.zeros((4, rows), dtype=torch.int64, device=x.device)
    block = _TORCH_BLOCK_PAIRS_CPU if x.device.type == "cpu" else _TORCH_BLOCK_PAIRS_DEVICE
    cols = min(m, block)
    per = max(1, min(rows, block // cols))  # rows per block
    buf_a = torch.empty(per * 4 * cols, dtype=torch.int64, device=x.device)
    buf_b = torch.empty_like(buf_a)
    for c0 in range(0, m, cols):
        ka = ka_all[:, q0 + c0 : q0 + min(m, c0 + cols)]  # (4, c)
        kb = kb_all[:, q0 + c0 : q0 + min(m, c0 + cols)]
        for r0 in range(0, rows, per):
            xs = x[r0 : r0 + per, c0 : c0 + cols]
            r, c = xs.shape
            if c >= _TORCH_NARROW:  # layout (row, lane, column): reduce contiguous columns
                shape, kx, ky, dim = (r, 4, c), ka[None], kb[None], 2
            else:  # few columns: (column, lane, row), so the sum adds whole vectors of rows
                shape, kx, ky, dim = (c, 4, r), ka.t()[:, :, None], kb.t()[:, :, None], 0
                xs = xs.t().contiguous()
            a = ((xs << 32) >> 32)[:, None, :]  # first word, sign-extended
            b = (xs >> 32)[:, None, :]  # second word, sign-extended
            big_a = torch.bitwise_xor(a, kx, out=buf_a[: r * 4 * c].view(shape))
            big_b = torch.bitwise_xor(b, ky, out=buf_b[: r * 4 * c].view(shape))
            big_a.mul_(big_b)  # |a ^ Ka| * |b ^ Kb| <= 2**62: exact
            sums = big_a.sum(dim=dim)  # wraps mod 2**64
            acc[:, r0 : r0 + r] += sums.t() if dim == 2 else sums
    return acc


def _accumulate_torch(sums: torch.Tensor, x: torch.Tensor, weights: torch.Tensor) -> None:
    """Add to ``sums`` (4, R) the weighted lane sums of rows ``x`` (R, m) from pair 0 on."""
    m = x.shape[1]
    for k, p0 in enumerate(range(0, m, PERIOD_PAIRS)):
        part = _lane_sums_torch(x[:, p0 : p0 + PERIOD_PAIRS], 0)
        sums += part.mul_(weights[:, k : k + 1])


def _hash_torch(data: torch.Tensor, chunk_size: int, out: torch.Tensor) -> None:
    n = data.numel()
    rows = num_chunks(n, chunk_size)
    cp = chunk_size // 8
    n_pairs = n // 8
    device = data.device
    x = data[: n_pairs * 8].view(torch.int64)
    weights = _block_weights_torch(num_chunks(cp, PERIOD_PAIRS), device)  # (4, periods)
    sums = torch.zeros((4, rows), dtype=torch.int64, device=device)  # lane-major: contiguous
    full = n_pairs // cp  # chunks made of whole pairs only
    if full:
        _accumulate_torch(sums[:, :full], x[: full * cp].view(full, cp), weights)
    rest = n_pairs - full * cp  # whole pairs of a short last chunk
    if rest:
        _accumulate_torch(sums[:, full:], x[full * cp :].view(1, rest), weights)
    tail = n - n_pairs * 8
    if tail:  # the last pair, zero-padded; it belongs to chunk rows - 1
        pad = torch.zeros(8, dtype=torch.uint8, device=device)
        pad[:tail] = data[n_pairs * 8 :]
        p = n_pairs - (rows - 1) * cp
        q, k = p % PERIOD_PAIRS, p // PERIOD_PAIRS
        part = _lane_sums_torch(pad.view(torch.int64).view(1, 1), q)
        sums[:, rows - 1 :] += part * weights[:, k : k + 1]
    lengths = torch.full((rows,), chunk_size, dtype=torch.int64, device=device)
    lengths[-1:].fill_(n - (rows - 1) * chunk_size)  # (item assignment would copy from the host: a sync)
    _finalize_torch(sums, lengths, out)


def _finalize_torch(sums: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor,
                    rows: torch.Tensor | None = None) -> None:
    """The hash words of lane sums ``sums`` (4, R) of chunks ``lengths`` (R) bytes long, into
    ``out`` (its rows ``rows``, else all of it); ``sums`` is used up."""
    for word in range(HASH_WORDS):
        h = _fmix64_torch(sums[2 * word].add_(lengths * _s64(_LC[word])))
        h = _fmix64_torch(h.bitwise_xor_(sums[2 * word + 1]))
        if rows is None:
            out[:, word] = h
        else:
            out[rows, word] = h


# ----------------------------------------------------------------------------------------
# Triton implementation: the same arithmetic in native unsigned types. Kernel 1 writes one
# partial lane sum per (chunk, period); kernel 2 weights and adds them, adds the zero-padded
# last pair, and finalizes. Two launches, no atomics, no host synchronization.

# NO_SPECIALIZE: Triton compiles a kernel once per combination of its integer arguments'
# divisibility by 16 (and int32/int64). Lengths and counts of arbitrary spans made every new
# combination a JIT compile in the middle of a save or restore (hundreds of ms each with a cold
# cache, on the thread that bounds the rate); the kernels' loops never used those hints (their
# trip counts go through min/max), so every runtime integer is left unspecialized.
if triton is not None:
    _T_G1 = tl.constexpr(_G1)
    _T_G2 = tl.constexpr(_G2)
    _T_MA0, _T_MA1, _T_MA2, _T_MA3 = (tl.constexpr(v) for v in _MA)
    _T_SA0, _T_SA1, _T_SA2, _T_SA3 = (tl.constexpr(v) for v in _SA)
    _T_MB0, _T_MB1, _T_MB2, _T_MB3 = (tl.constexpr(v) for v in _MB)
    _T_SB0, _T_SB1, _T_SB2, _T_SB3 = (tl.constexpr(v) for v in _SB)
    _T_F1 = tl.constexpr(_F1)
    _T_F2 = tl.constexpr(_F2)
    _T_WM0, _T_WM1, _T_WM2, _T_WM3 = (tl.constexpr(v) for v in _WM)
    _T_WA0, _T_WA1, _T_WA2, _T_WA3 = (tl.constexpr(v) for v in _WA)
    _T_LC0 = tl.constexpr(_LC[0])
    _T_LC1 = tl.constexpr(_LC[1])

    @triton.jit
    def _t_lane(a, b, u, ma: tl.constexpr, sa: tl.constexpr, mb: tl.constexpr, sb: tl.constexpr):
        ka = (u * ma + sa).to(tl.int32, bitcast=True)
        kb = (u * mb + sb).to(tl.int32, bitcast=True)
        return (a ^ ka).to(tl.int64) * (b ^ kb).to(tl.int64)  # one wide multiply

    @triton.jit
    def _t_terms(x, q):
        """Lane terms of pairs ``x`` (int64) at key indices ``q`` (int32, broadcastable)."""
        a = x.to(tl.int32)  # low word: the first one, little-endian
        b = (x >> 32).to(tl.int32)
        u = q.to(tl.uint32) * _T_G1
        u = u ^ (u >> 16)
        u = u * _T_G2
        u = u ^ (u >> 13)
        t0 = _t_lane(a, b, u, _T_MA0, _T_SA0, _T_MB0, _T_SB0)
        t1 = _t_lane(a, b, u, _T_MA1, _T_SA1, _T_MB1, _T_SB1)
        t2 = _t_lane(a, b, u, _T_MA2, _T_SA2, _T_MB2, _T_SB2)
        t3 = _t_lane(a, b, u, _T_MA3, _T_SA3, _T_MB3, _T_SB3)
        return t0, t1, t2, t3

    @triton.jit
    def _t_fmix64(x):
        x = x ^ (x >> 33)
        x = x * _T_F1
        x = x ^ (x >> 33)
        x = x * _T_F2
        return x ^ (x >> 33)

    @triton.jit
    def _t_weight(k, wm: tl.constexpr, wa: tl.constexpr):
        return _t_fmix64(tl.cast(k, tl.uint64) * wm + wa) | 1

    @triton.jit
    def _t_fold(t, FOLD: tl.constexpr):
        """Sum ``t`` [BLOCK] down to [BLOCK // FOLD]: adds within a thread, fewer registers."""
        if FOLD == 1:
            return t
        else:
            return tl.sum(tl.reshape(t, [FOLD, t.shape[0] // FOLD]), axis=0)

    @triton.jit
    def _t_stream(ptr, n, BLOCK: tl.constexpr, FOLD: tl.constexpr, PREFETCH: tl.constexpr):
        """Lane sums of the ``n`` pairs at ``ptr`` (int64 pointer, key indices from 0), streamed
        in BLOCK tiles. PREFETCH loads the next tile before hashing the current one, so that
        each thread keeps two tiles of loads in flight (Triton does not pipeline plain loads
        itself)."""
        offs = tl.arange(0, BLOCK)
        acc0 = tl.zeros([BLOCK // FOLD], tl.int64)
        acc1 = tl.zeros([BLOCK // FOLD], tl.int64)
        acc2 = tl.zeros([BLOCK // FOLD], tl.int64)
        acc3 = tl.zeros([BLOCK // FOLD], tl.int64)
        full = n // BLOCK  # whole tiles: no masks in the hot loop
        if PREFETCH:
            x = tl.load(ptr + offs, mask=offs < n, other=0)
            for i in range(full):
                cur = x
                x = tl.load(ptr + tl.minimum(i + 1, full - 1) * BLOCK + offs)
                t0, t1, t2, t3 = _t_terms(cur, i * BLOCK + offs)
                acc0 += _t_fold(t0, FOLD)
                acc1 += _t_fold(t1, FOLD)
                acc2 += _t_fold(t2, FOLD)
                acc3 += _t_fold(t3, FOLD)
        else:
            for i in range(full):
                q = i * BLOCK + offs
                t0, t1, t2, t3 = _t_terms(tl.load(ptr + q), q)
                acc0 += _t_fold(t0, FOLD)
                acc1 += _t_fold(t1, FOLD)
                acc2 += _t_fold(t2, FOLD)
                acc3 += _t_fold(t3, FOLD)
        rem = n - full * BLOCK
        if rem > 0:
            q = full * BLOCK + offs
            m = offs < rem
            t0, t1, t2, t3 = _t_terms(tl.load(ptr + q, mask=m, other=0), q)
            acc0 += _t_fold(tl.where(m, t0, 0), FOLD)
            acc1 += _t_fold(tl.where(m, t1, 0), FOLD)
            acc2 += _t_fold(tl.where(m, t2, 0), FOLD)
            acc3 += _t_fold(tl.where(m, t3, 0), FOLD)
        return tl.sum(acc0, axis=0), tl.sum(acc1, axis=0), tl.sum(acc2, axis=0), tl.sum(acc3, axis=0)

    @triton.jit(do_not_specialize=["n_pairs", "cp", "splits"])  # NO_SPECIALIZE (above)
    def _t_span_kernel(x_ptr, part_ptr, n_pairs, cp, splits, BLOCK: tl.constexpr,
                       PERIOD: tl.constexpr, FOLD: tl.constexpr, PREFETCH: tl.constexpr):
        """One program per (chunk, period): stream the period's pairs (``_t_stream``)."""
        pid = tl.program_id(0)
        chunk = pid // splits
        k = pid - chunk * splits
        base = chunk.to(tl.int64) * cp
        start = k.to(tl.int64) * PERIOD
        end = tl.minimum(tl.minimum(n_pairs - base, cp), start + PERIOD)
        n = tl.maximum(end - start, 0).to(tl.int32)
        ptr = x_ptr + base + start
        s0, s1, s2, s3 = _t_stream(ptr, n, BLOCK, FOLD, PREFETCH)
        dst = part_ptr + pid.to(tl.int64) * 4
        tl.store(dst + 0, s0)
        tl.store(dst + 1, s1)
        tl.store(dst + 2, s2)
        tl.store(dst + 3, s3)

    @triton.jit(do_not_specialize=["n_pairs", "cp", "n_chunks"])
    def _t_rows_kernel(x_ptr, part_ptr, n_pairs, cp, n_chunks, ROWS: tl.constexpr,
                       COLS: tl.constexpr):
        """Small chunks (cp <= COLS): one program per ROWS chunks, one tile each."""
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, COLS)[None, :]
        avail = tl.minimum(tl.maximum(n_pairs - rows * cp, 0), cp)
        m = cols < avail[:, None]
        x = tl.load(x_ptr + rows[:, None] * cp + cols, mask=m, other=0)
        t0, t1, t2, t3 = _t_terms(x, cols)
        ok = rows < n_chunks
        dst = part_ptr + rows * 4
        tl.store(dst + 0, tl.sum(tl.where(m, t0, 0), axis=1), mask=ok)
        tl.store(dst + 1, tl.sum(tl.where(m, t1, 0), axis=1), mask=ok)
        tl.store(dst + 2, tl.sum(tl.where(m, t2, 0), axis=1), mask=ok)
        tl.store(dst + 3, tl.sum(tl.where(m, t3, 0), axis=1), mask=ok)

    @triton.jit
    def _t_weighted_parts(part_ptr, c, cm, SPLITS: tl.constexpr):
        """Lane sums of chunks ``c`` (masked by ``cm``): each of their SPLITS periods' partial
        sums (``part``, 4 lanes per period) times that period's weight."""
        s0 = tl.zeros(c.shape, tl.uint64)
        s1 = tl.zeros(c.shape, tl.uint64)
        s2 = tl.zeros(c.shape, tl.uint64)
        s3 = tl.zeros(c.shape, tl.uint64)
        for k in range(SPLITS):
            src = part_ptr + (c * SPLITS + k) * 4
            p0 = tl.load(src + 0, mask=cm, other=0).to(tl.uint64, bitcast=True)
            p1 = tl.load(src + 1, mask=cm, other=0).to(tl.uint64, bitcast=True)
            p2 = tl.load(src + 2, mask=cm, other=0).to(tl.uint64, bitcast=True)
            p3 = tl.load(src + 3, mask=cm, other=0).to(tl.uint64, bitcast=True)
            s0 += _t_weight(k, _T_WM0, _T_WA0) * p0
            s1 += _t_weight(k, _T_WM1, _T_WA1) * p1
            s2 += _t_weight(k, _T_WM2, _T_WA2) * p2
            s3 += _t_weight(k, _T_WM3, _T_WA3) * p3
        return s0, s1, s2, s3

    @triton.jit
    def _t_add_pair(s0, s1, s2, s3, xt, pt, use, PERIOD: tl.constexpr):
        """Add pair ``xt`` (a zero-padded last pair) at pair index ``pt`` where ``use``."""
        kt = pt // PERIOD
        t0, t1, t2, t3 = _t_terms(xt.to(tl.int64, bitcast=True), (pt % PERIOD).to(tl.int32))
        s0 += tl.where(use, _t_weight(kt, _T_WM0, _T_WA0) * t0.to(tl.uint64, bitcast=True), 0)
        s1 += tl.where(use, _t_weight(kt, _T_WM1, _T_WA1) * t1.to(tl.uint64, bitcast=True), 0)
        s2 += tl.where(use, _t_weight(kt, _T_WM2, _T_WA2) * t2.to(tl.uint64, bitcast=True), 0)
        s3 += tl.where(use, _t_weight(kt, _T_WM3, _T_WA3) * t3.to(tl.uint64, bitcast=True), 0)
        return s0, s1, s2, s3

    @triton.jit
    def _t_store_hashes(out_ptr, c, cm, s0, s1, s2, s3, length):
        """Mix the lane sums with each chunk's byte ``length`` (uint64) into its 128-bit hash."""
        h0 = _t_fmix64(_t_fmix64(s0 + length * _T_LC0) ^ s1)
        h1 = _t_fmix64(_t_fmix64(s2 + length * _T_LC1) ^ s3)
        tl.store(out_ptr + c * 2, h0.to(tl.int64, bitcast=True), mask=cm)
        tl.store(out_ptr + c * 2 + 1, h1.to(tl.int64, bitcast=True), mask=cm)

    @triton.jit(do_not_specialize=["n_chunks", "nbytes", "chunk_size", "cp", "n_pairs", "tail_start", "tail"])
    def _t_finalize_kernel(part_ptr, bytes_ptr, out_ptr, n_chunks, nbytes, chunk_size, cp,
                           n_pairs, tail_start, tail, SPLITS: tl.constexpr,
                           BLOCK_C: tl.constexpr, PERIOD: tl.constexpr):
        # Integer arguments below 2**31 arrive as int32: products that can pass 2**31 are
        # taken in int64 (``c``) or computed on the host (``tail_start`` = 8 * n_pairs).
        # SPLITS (periods per chunk) is a compile-time constant: one compile per chunk size.
        pid = tl.program_id(0)
        c = pid.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = c < n_chunks
        s0, s1, s2, s3 = _t_weighted_parts(part_ptr, c, cm, SPLITS)
        if tail > 0:  # the zero-padded last pair of the last chunk
            i = tl.arange(0, 8)
            byte = tl.load(bytes_ptr + tail_start + i, mask=i < tail, other=0)
            xt = tl.sum(byte.to(tl.uint64) << (i * 8).to(tl.uint64), axis=0)
            pt = n_pairs - (n_chunks - 1) * cp
            s0, s1, s2, s3 = _t_add_pair(s0, s1, s2, s3, xt, pt, c == n_chunks - 1, PERIOD)
        length = tl.minimum(nbytes - c * chunk_size, chunk_size).to(tl.uint64)
        _t_store_hashes(out_ptr, c, cm, s0, s1, s2, s3, length)


def _hash_triton(
    data: torch.Tensor, chunk_size: int, out: torch.Tensor, config: TritonConfig
) -> None:
    """Enqueue both kernels on the current stream of ``data``'s device."""
    n = data.numel()
    rows = num_chunks(n, chunk_size)
    cp = chunk_size // 8
    n_pairs = n // 8
    x = data[: n_pairs * 8].view(torch.int64)
    block = config.block_pairs
    # Triton launches on the current device; CPU tensors only reach here under its interpreter.
    guard = torch.cuda.device(data.device) if data.is_cuda else contextlib.nullcontext()
    with guard, launch_hooks.internal():  # our own kernels, not the program's launches
        if cp <= min(block, PERIOD_PAIRS):  # whole chunks in one tile, all in period 0
            cols = triton.next_power_of_2(cp)
            per = max(1, block // cols)
            splits = 1
            part = torch.empty((rows, splits, 4), dtype=torch.int64, device=data.device)
            _t_rows_kernel[(triton.cdiv(rows, per),)](
                x, part, n_pairs, cp, rows, ROWS=per, COLS=cols, num_warps=config.num_warps
            )
        else:
            splits = num_chunks(cp, PERIOD_PAIRS)
            part = torch.empty((rows, splits, 4), dtype=torch.int64, device=data.device)
            # fold accumulators to 2 pairs per thread: each thread adds its own tile elements
            fold = max(1, block // (64 * config.num_warps))
            _t_span_kernel[(rows * splits,)](
                x, part, n_pairs, cp, splits, BLOCK=block, PERIOD=PERIOD_PAIRS, FOLD=fold,
                PREFETCH=config.prefetch, num_warps=config.num_warps,
            )
        block_c = 128
        _t_finalize_kernel[(triton.cdiv(rows, block_c),)](
            part, data, out, rows, n, chunk_size, cp, n_pairs, n_pairs * 8, n - n_pairs * 8,
            SPLITS=splits, BLOCK_C=block_c, PERIOD=PERIOD_PAIRS, num_warps=4,
        )
