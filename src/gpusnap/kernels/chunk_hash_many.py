"""The chunk hash of many spans of one device in one call: the same bits as
:func:`~gpusnap.kernels.chunk_hash.chunk_hashes` on each span, for a fraction of the host time.

``save()`` hashes every storage span at the consistent point, on the program's stream; one
:func:`chunk_hashes` call per span costs the calling thread two launches plus Python (about
0.18 ms), hundreds of times per save. :func:`chunk_hashes_many` enqueues the same
work as three operations whatever the number of spans: one host-to-device copy of a row table
and two kernels.

Row table (int64, shape ``(2, rows)``, built on the host with a few vectorized NumPy ops):
``table[0, r]`` is the address of row ``r``'s chunk (span start + chunk index * chunk size) and
``table[1, r]`` its true length ``L`` in bytes. That is all a row needs: its whole pairs are
``L // 8`` at that address (key indices from 0, as for any chunk), and a chunk with ``L % 8``
bytes left over is the last one of its span, whose zero-padded last pair sits at pair index
``L // 8``. The kernels are those of :mod:`~gpusnap.kernels.chunk_hash` with the per-chunk
pointer and length read from the table instead of computed from one span's base; the hot loop
(``_t_stream``) is shared, so the per-byte work is the same.

The table goes to the device from pinned memory without the host waiting; PyTorch's pinned
(caching host) allocator keeps that buffer until the copy has completed, so it can be dropped
right away. CPU tensors, and CUDA without Triton, loop over :func:`chunk_hashes` instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from gpusnap import launch_hooks
from gpusnap.kernels import chunk_hash as _ch
from gpusnap.kernels.chunk_hash import (
    DEFAULT_TRITON_CONFIG,
    HASH_WORDS,
    TritonConfig,
    chunk_hashes,
    num_chunks,
)

triton, tl = _ch.triton, _ch.tl

__all__ = ["chunk_hashes_many", "chunk_hashes_packed"]


def chunk_hashes_many(
    spans: Sequence[torch.Tensor],
    chunk_size: int,
    out: torch.Tensor,
    *,
    impl: Literal["auto", "torch", "triton"] = "auto",
) -> torch.Tensor:
    """Chunk hashes of every span of ``spans`` into ``out``: span ``i``'s rows follow span
    ``i - 1``'s, so ``out`` equals ``torch.cat([chunk_hashes(s, chunk_size) for s in spans])``.

    Each span is a 1-D contiguous uint8 tensor on ``out``'s device (any length, 0 included,
    any start: unaligned spans are hashed from an aligned copy); ``out`` is a contiguous int64
    tensor of shape ``(sum of num_chunks, 2)``. On CUDA with Triton: one host-to-device copy
    and two kernels on the current stream, the host never waits; otherwise one
    :func:`chunk_hashes` per span. ``impl`` as for :func:`chunk_hashes`.
    """
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', not {impl!r}")
    counts = []
    for i, span in enumerate(spans):
        _ch._check(span, chunk_size)
        if span.device != out.device:
            raise ValueError(f"span {i} is on {span.device}, out on {out.device}: hash the "
                             "spans of each device with their own call")
        counts.append(num_chunks(span.numel(), chunk_size))
    total = sum(counts)
    if not _triton_or_torch(out, total, impl):
        return out
    if impl == "triton" or (impl == "auto" and out.is_cuda and triton is not None):
        _hash_triton_many(spans, counts, chunk_size, out, DEFAULT_TRITON_CONFIG)
    else:
        row = 0
        for span, count in zip(spans, counts):
            if count:
                chunk_hashes(span, chunk_size, out=out[row : row + count], impl=impl)
                row += count
    return out


def _triton_or_torch(out: torch.Tensor, total: int, impl: str) -> bool:
    """Check ``out`` holds ``total`` rows and ``impl`` can run; False: nothing to hash."""
    if out.shape != (total, HASH_WORDS) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous int64 tensor of shape ({total}, {HASH_WORDS}); got "
            f"{tuple(out.shape)} {out.dtype}"
        )
    if impl == "triton" and (triton is None or not out.is_cuda):
        raise RuntimeError("impl='triton' needs Triton installed and CUDA tensors")
    return total > 0


def _row_table(
    spans: Sequence[torch.Tensor], counts: Sequence[int], chunk_size: int, host: torch.Tensor
) -> None:
    """Fill ``host`` (int64, (2, rows), on the CPU) with each row's chunk address and length.

    NumPy on the host, not torch ops: each torch call costs the calling thread several times
    a NumPy call's host time, and a restore's copy thread builds one table per batch (the
    torch version took ~35% of its samples)."""
    _rows_from_arrays(*_span_arrays(spans, counts), chunk_size, host)


def _span_arrays(spans: Sequence[torch.Tensor], counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Address, length and chunk count of each span that has chunks."""
    used = [i for i, c in enumerate(counts) if c]
    starts = np.fromiter((spans[i].data_ptr() for i in used), dtype=np.int64, count=len(used))
    sizes = np.fromiter((spans[i].numel() for i in used), dtype=np.int64, count=len(used))
    per = np.fromiter((counts[i] for i in used), dtype=np.int64, count=len(used))
    return starts, sizes, per


def _rows_from_arrays(starts: np.ndarray, sizes: np.ndarray, per: np.ndarray, chunk_size: int, host: torch.Tensor) -> None:
    """The row table of spans given as arrays: address, length and chunk count of each span
    that has chunks."""
    total = host.shape[1]
    first = np.cumsum(per) - per  # each span's first row
    offset = np.arange(total, dtype=np.int64)
    offset -= np.repeat(first, per)
    offset *= chunk_size  # each row's byte offset in its span
    view = host.numpy()
    np.add(np.repeat(starts, per), offset, out=view[0])
    np.minimum(np.repeat(sizes, per) - offset, chunk_size, out=view[1])


def chunk_hashes_packed(
    buffer: torch.Tensor,
    offsets: Sequence[int] | np.ndarray,
    sizes: Sequence[int] | np.ndarray,
    chunk_size: int,
    out: torch.Tensor,
    *,
    impl: Literal["auto", "torch", "triton"] = "auto",
) -> torch.Tensor:
    """:func:`chunk_hashes_many` of the spans ``buffer[offsets[i] : offsets[i] + sizes[i]]``,
    without a tensor per span: the row table comes from the two arrays. For many spans packed
    in one buffer (a save's whole-state snapshot: 1745 tensors of GPT-2 large), whose hashing
    thread competes for the GIL with the program; per-span views and checks were most of its
    host time.

    ``buffer``: 1-D contiguous uint8; on the Triton path every offset must be a multiple of
    16 (the kernels' wide loads). ``out`` as for :func:`chunk_hashes_many`.

    Example::

        buf = torch.zeros(64, dtype=torch.uint8)
        out = torch.empty((2, 2), dtype=torch.int64)
        chunk_hashes_packed(buf, [0, 32], [16, 20], 16, out)  # one row, then two
    """
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', not {impl!r}")
    _ch._check(buffer, chunk_size)
    offs = np.asarray(offsets, dtype=np.int64)
    lens = np.asarray(sizes, dtype=np.int64)
    if offs.shape != lens.shape or offs.ndim != 1:
        raise ValueError("offsets and sizes must be 1-D and of one length")
    if len(offs) and (offs.min() < 0 or lens.min() < 0 or (offs + lens).max() > buffer.numel()):
        raise ValueError("every span must lie within the buffer")
    per = -(-lens // chunk_size)
    total = int(per.sum())
    if buffer.device != out.device:
        raise ValueError(f"buffer is on {buffer.device}, out on {out.device}")
    if not _triton_or_torch(out, total, impl):
        return out
    triton_path = impl == "triton" or (impl == "auto" and out.is_cuda and triton is not None)
    if triton_path and not ((offs % 16 == 0).all() and buffer.data_ptr() % 16 == 0):
        triton_path = False
        if impl == "triton":
            raise ValueError("impl='triton' needs every span 16-byte aligned")
    if not triton_path:  # (per-span views: the CPU, or unaligned spans)
        return chunk_hashes_many([buffer[o : o + n] for o, n in zip(offs.tolist(), lens.tolist())],
                                 chunk_size, out, impl=impl)
    used = per > 0
    _launch_many(buffer.data_ptr() + offs[used], lens[used], per[used], total, chunk_size, out,
                 DEFAULT_TRITON_CONFIG)
    return out


def _hash_triton_many(
    spans: Sequence[torch.Tensor],
    counts: Sequence[int],
    chunk_size: int,
    out: torch.Tensor,
    config: TritonConfig,
) -> None:
    """Enqueue the table copy and both kernels on the current stream of ``out``'s device."""
    # The loads need 16-byte aligned chunks; the copies live until the kernels are enqueued,
    # which is enough: the caching allocator reuses their memory in this stream's order.
    spans = [s.clone() if c and s.data_ptr() % 16 else s for s, c in zip(spans, counts)]
    _launch_many(*_span_arrays(spans, counts), out.shape[0], chunk_size, out, config)
    del spans  # (the aligned copies: see above)


def _launch_many(
    starts: np.ndarray,
    sizes: np.ndarray,
    per: np.ndarray,
    rows: int,
    chunk_size: int,
    out: torch.Tensor,
    config: TritonConfig,
) -> None:
    """The row table of spans given as arrays (address, length, chunks; chunked spans only),
    to the device, then both kernels, on the current stream of ``out``'s device."""
    cp = chunk_size // 8
    block = config.block_pairs
    guard = torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext()
    with guard, launch_hooks.internal():  # our own kernels, not the program's launches
        if out.is_cuda:
            host = torch.empty((2, rows), dtype=torch.int64, pin_memory=True)
            _rows_from_arrays(starts, sizes, per, chunk_size, host)
            table = torch.empty_like(host, device=out.device)
            table.copy_(host, non_blocking=True)
        else:  # Triton's interpreter: the table is read where it is
            table = torch.empty((2, rows), dtype=torch.int64)
            _rows_from_arrays(starts, sizes, per, chunk_size, table)
        if cp <= min(block, _ch.PERIOD_PAIRS):  # whole chunks in one tile, all in period 0
            cols = triton.next_power_of_2(cp)
            tile_rows = max(1, block // cols)
            splits = 1
            part = torch.empty((rows, splits, 4), dtype=torch.int64, device=out.device)
            _t_many_rows_kernel[(triton.cdiv(rows, tile_rows),)](
                table, part, rows, ROWS=tile_rows, COLS=cols, num_warps=config.num_warps
            )
        else:
            splits = num_chunks(cp, _ch.PERIOD_PAIRS)
            part = torch.empty((rows, splits, 4), dtype=torch.int64, device=out.device)
            fold = max(1, block // (64 * config.num_warps))  # as _hash_triton
            _t_many_span_kernel[(rows * splits,)](
                table, part, rows, splits, BLOCK=block, PERIOD=_ch.PERIOD_PAIRS, FOLD=fold,
                PREFETCH=config.prefetch, num_warps=config.num_warps,
            )
        block_c = 128
        _t_many_finalize_kernel[(triton.cdiv(rows, block_c),)](
            table, part, out, rows, SPLITS=splits, BLOCK_C=block_c, PERIOD=_ch.PERIOD_PAIRS,
            num_warps=4,
        )


if triton is not None:
    from gpusnap.kernels.chunk_hash import (  # the shared definition's Triton pieces
        _t_add_pair,
        _t_store_hashes,
        _t_stream,
        _t_terms,
        _t_weighted_parts,
    )

    @triton.jit(do_not_specialize=["n_rows", "splits"])  # see chunk_hash's NO_SPECIALIZE
    def _t_many_span_kernel(table_ptr, part_ptr, n_rows, splits, BLOCK: tl.constexpr,
                            PERIOD: tl.constexpr, FOLD: tl.constexpr, PREFETCH: tl.constexpr):
        """One program per (row, period), as ``_t_span_kernel``; the row's chunk from the table.

        Addresses are multiples of 16 (aligned span starts, chunk sizes multiples of 16): the
        hint lets the loads be as wide as the single-span kernel's.
        """
        pid = tl.program_id(0)
        row = pid // splits
        k = pid - row * splits
        addr = tl.load(table_ptr + row)
        length = tl.load(table_ptr + n_rows + row)
        start = k.to(tl.int64) * PERIOD
        end = tl.minimum(length // 8, start + PERIOD)
        n = tl.maximum(end - start, 0).to(tl.int32)
        base = tl.multiple_of(addr.to(tl.pointer_type(tl.int64)), 16)
        s0, s1, s2, s3 = _t_stream(base + start, n, BLOCK, FOLD, PREFETCH)
        dst = part_ptr + pid.to(tl.int64) * 4
        tl.store(dst + 0, s0)
        tl.store(dst + 1, s1)
        tl.store(dst + 2, s2)
        tl.store(dst + 3, s3)

    @triton.jit(do_not_specialize=["n_rows"])
    def _t_many_rows_kernel(table_ptr, part_ptr, n_rows, ROWS: tl.constexpr,
                            COLS: tl.constexpr):
        """Small chunks (cp <= COLS), as ``_t_rows_kernel``: ROWS table rows per program."""
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
        ok = rows < n_rows
        addr = tl.load(table_ptr + rows, mask=ok, other=0)
        length = tl.load(table_ptr + n_rows + rows, mask=ok, other=0)
        cols = tl.arange(0, COLS)[None, :]
        m = cols < (length // 8)[:, None]
        base = tl.multiple_of(addr.to(tl.pointer_type(tl.int64)), 16)
        x = tl.load(base[:, None] + cols, mask=m, other=0)
        t0, t1, t2, t3 = _t_terms(x, cols)
        dst = part_ptr + rows * 4
        tl.store(dst + 0, tl.sum(tl.where(m, t0, 0), axis=1), mask=ok)
        tl.store(dst + 1, tl.sum(tl.where(m, t1, 0), axis=1), mask=ok)
        tl.store(dst + 2, tl.sum(tl.where(m, t2, 0), axis=1), mask=ok)
        tl.store(dst + 3, tl.sum(tl.where(m, t3, 0), axis=1), mask=ok)

    @triton.jit(do_not_specialize=["n_rows"])
    def _t_many_finalize_kernel(table_ptr, part_ptr, out_ptr, n_rows, SPLITS: tl.constexpr,
                                BLOCK_C: tl.constexpr, PERIOD: tl.constexpr):
        """As ``_t_finalize_kernel``, per table row: a row with ``L % 8`` leftover bytes adds
        its zero-padded last pair at pair index ``L // 8``."""
        pid = tl.program_id(0)
        c = pid.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = c < n_rows
        addr = tl.load(table_ptr + c, mask=cm, other=0)
        length = tl.load(table_ptr + n_rows + c, mask=cm, other=0)
        s0, s1, s2, s3 = _t_weighted_parts(part_ptr, c, cm, SPLITS)
        pt = length // 8  # whole pairs; a last chunk's leftover bytes form pair pt
        tail = length - pt * 8
        i = tl.arange(0, 8)[None, :]
        tail_ptr = (addr + pt * 8).to(tl.pointer_type(tl.uint8))
        byte = tl.load(tail_ptr[:, None] + i, mask=cm[:, None] & (i < tail[:, None]), other=0)
        xt = tl.sum(byte.to(tl.uint64) << (i * 8).to(tl.uint64), axis=1)
        s0, s1, s2, s3 = _t_add_pair(s0, s1, s2, s3, xt, pt, tail > 0, PERIOD)
        _t_store_hashes(out_ptr, c, cm, s0, s1, s2, s3, length.to(tl.uint64))
