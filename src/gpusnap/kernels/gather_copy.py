"""Copy many device spans, given by address, into one buffer with one kernel launch.

``save()`` snapshots a whole training state (GPT-2 large: 1745 storages, 9.3 GB) device to
device at the consistent point, on the program's stream. Through PyTorch that meant a uint8
alias per storage, a ``split`` of the destination into as many views, and a
``_foreach_copy_`` over both lists: a few tensor objects per storage, most of ``save()``'s
host time after ``flatten`` (BENCHMARKS.md). Here the spans are three NumPy
arrays (source address, destination offset, length); the host builds a tile table from them
with a few vectorized operations, copies it to the device from pinned memory without
waiting, and launches one kernel whatever the number of spans.

Tile table (int64, shape ``(3, tiles)``): each span is cut into tiles of at most
``tile_bytes``; ``table[0, r]`` is tile ``r``'s source address, ``table[1, r]`` its destination
address and ``table[2, r]`` its length. One program copies one tile: 16 bytes at a time where
both addresses are 16-byte aligned (every span start is, in practice: the caching allocator's
blocks are 512-byte aligned and snapshots are laid out 16-byte aligned), then byte by byte
for what is left (an unaligned span, a length not a multiple of 16).

The caller keeps the sources alive and unchanged until the copy has run in the current
stream's order, as for any asynchronous copy. Without Triton (or on the CPU) use
:func:`gather_copy_tensors`, the same copy through ``_foreach_copy_``.

Example (CUDA, with Triton)::

    a = torch.arange(10, dtype=torch.float32, device="cuda")
    b = torch.ones(3, dtype=torch.int16, device="cuda")
    out = torch.empty(64, dtype=torch.uint8, device="cuda")
    gather_copy(out, [0, 48], [a.data_ptr(), b.data_ptr()], [40, 6])
    # out[:40] holds a's bytes, out[48:54] b's
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from gpusnap import launch_hooks
from gpusnap.kernels import chunk_hash as _ch

triton, tl = _ch.triton, _ch.tl

__all__ = [
    "DEFAULT_TILE_BYTES", "gather_copy", "gather_copy_available", "gather_copy_host", "gather_copy_tensors", "tile_table",
]

# Launch shape: the best of a sweep (4.99 ms for GPT-2 large's 9.29 GB, 1862 GB/s, against
# 4.32 ms for one device copy of as many bytes; the other shapes tried took 5.0-6.2 ms)
DEFAULT_TILE_BYTES = 4 << 20  # per program: spreads a 9 GB snapshot over ~2.3k programs
DEFAULT_BLOCK_WORDS = 2048  # int64 words per loop step (16 KiB)
DEFAULT_NUM_WARPS = 16
_BLOCK_BYTES = 1024  # bytes per step of the unaligned remainder


def gather_copy_available(device: torch.device) -> bool:
    """Whether :func:`gather_copy` can run for tensors on ``device``."""
    return device.type == "cuda" and triton is not None


def tile_table(
    dst_base: int,
    dst_offsets: Sequence[int] | np.ndarray,
    src_addrs: Sequence[int] | np.ndarray,
    sizes: Sequence[int] | np.ndarray,
    tile_bytes: int = DEFAULT_TILE_BYTES,
) -> np.ndarray:
    """The ``(3, tiles)`` int64 table (source, destination, length per tile) of the copies
    ``[src_addrs[i], + sizes[i]) -> dst_base + dst_offsets[i]``; empty spans have no tile."""
    if tile_bytes <= 0 or tile_bytes % 16:
        raise ValueError(f"tile_bytes must be a positive multiple of 16, got {tile_bytes}")
    src = np.asarray(src_addrs, dtype=np.int64)
    dst = np.asarray(dst_offsets, dtype=np.int64) + dst_base
    n = np.asarray(sizes, dtype=np.int64)
    if not (src.shape == dst.shape == n.shape) or src.ndim != 1:
        raise ValueError("dst_offsets, src_addrs and sizes must be 1-D and of one length")
    if len(n) and n.min() < 0:
        raise ValueError("sizes must not be negative")
    per = -(-n // tile_bytes)  # tiles per span
    rows = int(per.sum())
    first = np.cumsum(per) - per
    within = np.arange(rows, dtype=np.int64) - np.repeat(first, per)
    within *= tile_bytes  # each tile's byte offset in its span
    table = np.empty((3, rows), dtype=np.int64)
    np.add(np.repeat(src, per), within, out=table[0])
    np.add(np.repeat(dst, per), within, out=table[1])
    np.minimum(np.repeat(n, per) - within, tile_bytes, out=table[2])
    return table


def gather_copy(
    dst: torch.Tensor,
    dst_offsets: Sequence[int] | np.ndarray,
    src_addrs: Sequence[int] | np.ndarray,
    sizes: Sequence[int] | np.ndarray,
    *,
    tile_bytes: int = DEFAULT_TILE_BYTES,
    block_words: int = DEFAULT_BLOCK_WORDS,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> torch.Tensor:
    """Copy ``sizes[i]`` bytes from device address ``src_addrs[i]`` to
    ``dst[dst_offsets[i]:]`` for every ``i``, on the current stream of ``dst``'s device: one
    host-to-device copy of the tile table and one kernel; the host never waits.

    ``dst``: a contiguous 1-D uint8 CUDA tensor; every source must lie on its device (raw
    addresses cannot be checked: the caller's promise). Destinations are checked to lie within
    ``dst``; overlapping destinations are the caller's error, as for any copy.
    ``tile_bytes``, ``block_words`` (int64 words per loop step, a power of two) and
    ``num_warps`` shape the launch."""
    if not gather_copy_available(dst.device):
        raise RuntimeError("gather_copy needs Triton and a CUDA tensor (else use gather_copy_tensors)")
    if dst.dtype != torch.uint8 or dst.dim() != 1 or not dst.is_contiguous():
        raise ValueError("dst must be a contiguous 1-D uint8 tensor")
    offs, src, n = _checked_spans(dst, dst_offsets, src_addrs, sizes)
    table = tile_table(dst.data_ptr(), offs, src, n, tile_bytes)
    rows = table.shape[1]
    if not rows:
        return dst
    with torch.cuda.device(dst.device), launch_hooks.internal():  # ours, not a program launch
        host = torch.from_numpy(table).pin_memory()
        # (the caching host allocator keeps ``host`` until the copy has run: dropped at once)
        device_table = torch.empty_like(host, device=dst.device)
        device_table.copy_(host, non_blocking=True)
        _t_gather_kernel[(rows,)](device_table, rows, BLOCK=block_words, BLOCK_B=_BLOCK_BYTES,
                                  num_warps=num_warps)
    return dst


def gather_copy_host(dst: torch.Tensor, dst_offsets: Sequence[int] | np.ndarray,
                     src_addrs: Sequence[int] | np.ndarray, sizes: Sequence[int] | np.ndarray) -> torch.Tensor:
    """:func:`gather_copy` for host memory, done now: one ``memmove`` per span, by address.

    A CPU snapshot at ``save()`` is mostly many tiny spans (an AdamW state has a 0-dim ``step``
    tensor per parameter: 436 of 1745 tensors on GPT-2 large); a uint8 alias of each for
    ``_foreach_copy_`` cost ~5 us of the caller's time per span, an address and a memmove
    well under 1 us. ``dst``: a contiguous 1-D uint8 CPU tensor; the sources, host memory
    that the caller keeps alive (their addresses cannot be checked)."""
    if dst.device.type != "cpu" or dst.dtype != torch.uint8 or dst.dim() != 1 or not dst.is_contiguous():
        raise ValueError("dst must be a contiguous 1-D uint8 CPU tensor")
    offs, src, n = _checked_spans(dst, dst_offsets, src_addrs, sizes)
    move, base = ctypes.memmove, dst.data_ptr()
    for d, s, k in zip((offs + base).tolist(), src.tolist(), n.tolist()):
        move(d, s, k)
    return dst


def _checked_spans(
    dst: torch.Tensor,
    dst_offsets: Sequence[int] | np.ndarray,
    src_addrs: Sequence[int] | np.ndarray,
    sizes: Sequence[int] | np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The three arrays of a gather into ``dst``, checked: one length each, no negative size,
    every destination within ``dst``, no source in the null page region (otherwise sources
    are raw addresses: they cannot be checked)."""
    offs = np.asarray(dst_offsets, dtype=np.int64)
    src = np.asarray(src_addrs, dtype=np.int64)
    n = np.asarray(sizes, dtype=np.int64)
    if not (offs.shape == src.shape == n.shape) or offs.ndim != 1:
        raise ValueError("dst_offsets, src_addrs and sizes must be 1-D and of one length")
    if len(n) and n.min() < 0:
        raise ValueError("sizes must not be negative")
    if len(offs) and (offs.min() < 0 or (offs + n).max() > dst.numel()):
        raise ValueError("every destination must lie within dst")
    if len(src) and ((src < _LOWEST_ADDRESS) & (n > 0)).any():
        # (no mapping lives there: a storage freed under its tensor, whose data pointer is 0,
        # plus the span's offset; the copy would crash, or on CUDA fault the whole context)
        raise ValueError("a source address lies in the first 64 KiB: a freed storage (data pointer 0)")
    return offs, src, n


_LOWEST_ADDRESS = 1 << 16  # Linux's default vm.mmap_min_addr: nothing, host or device, is mapped below


def gather_copy_tensors(dst: torch.Tensor, dst_offsets: Sequence[int], sources: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`gather_copy` through PyTorch, from 1-D uint8 ``sources`` on ``dst``'s device
    (the CPU, or CUDA without Triton): one ``_foreach_copy_`` into views of ``dst``."""
    if not sources:
        return dst
    with contextlib.ExitStack() as guard:
        if dst.is_cuda:
            guard.enter_context(torch.cuda.device(dst.device))
        views = [dst[o : o + s.numel()] for o, s in zip(dst_offsets, sources)]
        torch._foreach_copy_(views, list(sources))
    return dst


if triton is not None:

    @triton.jit(do_not_specialize=["n_rows"])  # (see chunk_hash's NO_SPECIALIZE)
    def _t_gather_kernel(table_ptr, n_rows, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr):
        """One program per tile: 16-byte moves while both addresses allow, then bytes."""
        pid = tl.program_id(0)
        src = tl.load(table_ptr + pid)
        dst = tl.load(table_ptr + n_rows + pid)
        length = tl.load(table_ptr + 2 * n_rows + pid)
        done = length * 0
        if ((src | dst) & 15) == 0:
            words = (length // 16) * 2  # int64 words in whole 16-byte units
            s64 = tl.multiple_of(src.to(tl.pointer_type(tl.int64)), 16)
            d64 = tl.multiple_of(dst.to(tl.pointer_type(tl.int64)), 16)
            full = (words // BLOCK) * BLOCK
            for i in range(0, full, BLOCK):
                o = tl.multiple_of(i, BLOCK) + tl.arange(0, BLOCK)
                tl.store(d64 + o, tl.load(s64 + o))
            o = full + tl.arange(0, BLOCK)
            m = o < words
            tl.store(d64 + o, tl.load(s64 + o, mask=m), mask=m)
            done = words * 8
        s8 = src.to(tl.pointer_type(tl.uint8))
        d8 = dst.to(tl.pointer_type(tl.uint8))
        for i in range(done, length, BLOCK_B):
            o = i + tl.arange(0, BLOCK_B)
            m = o < length
            tl.store(d8 + o, tl.load(s8 + o, mask=m), mask=m)
