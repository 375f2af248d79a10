"""Verification on the device: a piece's chunks are checked after the copy, not hashed on the host.

When the manifest carries device hashes (``StorageEntry.hashes``, :data:`DEVICE_HASH`,
computed at the consistent point by :func:`~gpusnap.kernels.chunk_hash.chunk_hashes`), a
piece bound for one CUDA device is copied host-to-device into a *scratch* slot and hashed
there on the copy stream; the hashes (16 bytes a chunk) come back with one small
device-to-host copy of the slot's whole hash buffer. The copy thread compares them with the
expected rows on the host (numpy, after the piece's event) before it copies scratch into the
targets, device to device: a corrupt chunk never lands in a target, the same guarantee as
``verify="stream"`` on the host, without the host's BLAKE2b pass (about 1 GB/s per core
against 55 GB/s of host-to-device bandwidth). Comparing on the host rather than with device
kernels saves the copy thread, which bounds the restore rate, four torch calls a piece (45 µs
of its ~215 µs, BENCHMARKS.md).

Each device has a ring of ``slots`` scratch slots used in turn, so the copy thread checks a
piece while the next ones are already being copied: the host waits for a piece only when its
slot comes round again, and the copy engine never idles for the check.

Device-agnostic: on CPU the same code runs with CPU tensors (the tests force it on), so the
mismatch handling is exercised without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpusnap.errors import CheckpointError
from gpusnap.kernels.chunk_hash import HASH_WORDS, chunk_hashes
from gpusnap.kernels.chunk_hash_many import chunk_hashes_many
from gpusnap.restore.pipeline.schedule import LoadSpan, Piece
from gpusnap.storage.manifest import Manifest

__all__ = ["DeviceCheck", "ScratchSlot", "hex_to_hashes"]

_HEX_DIGITS = 16 * HASH_WORDS  # 32: two 64-bit words


def hex_to_hashes(hexes: Sequence[str]) -> torch.Tensor:
    """The inverse of :func:`~gpusnap.kernels.chunk_hash.hashes_to_hex`: an (n, 2) int64 tensor.

    Each word is written as the 16 hex digits of its unsigned value (``v & (2**64 - 1)``);
    read back big-endian as a *signed* int64 it is the word ``chunk_hashes`` computed.

    >>> hex_to_hashes(["ffffffffffffffff0000000000000001"]).tolist()
    [[-1, 1]]
    """
    for h in hexes:
        if len(h) != _HEX_DIGITS:
            raise CheckpointError(f"a device hash must be {_HEX_DIGITS} hex digits, got {h!r}")
    try:
        raw = bytearray.fromhex("".join(hexes))
    except ValueError as exc:
        raise CheckpointError(f"malformed device hash in the manifest: {exc}") from None
    if not raw:
        return torch.empty((0, HASH_WORDS), dtype=torch.int64)
    big_endian = torch.frombuffer(raw, dtype=torch.uint8).view(-1, 8)
    native = big_endian.flip(1) if _LITTLE_ENDIAN else big_endian
    return native.contiguous().view(torch.int64).view(-1, HASH_WORDS)


_LITTLE_ENDIAN = torch.tensor([1], dtype=torch.int16).view(torch.uint8)[0].item() == 1


@dataclass(eq=False)
class ScratchSlot:
    """One batch's room on the device (a piece, or several small whole spans), and its check
    until the copy thread resolves it."""

    device: torch.device
    data: torch.Tensor  # uint8 on ``device``, one region long
    hashes: torch.Tensor  # int64 (max_chunks, 2) on ``device``: the batch's chunk hashes first
    host_hashes: torch.Tensor  # the same on the host (pinned for CUDA), copied after the hash
    pinned: bool = False  # host_hashes is page-locked (CUDA): its copy is asynchronous
    pieces: list[tuple[Piece, int]] = field(default_factory=list)  # (piece, offset in data), checked, not yet applied
    event: Any = None  # after the batch's hash and its copy to the host (None on CPU)
    source: Any = None  # where the batch's bytes are: ``data``, or a landing slot (``landed``)
    landed: bool = False  # the batch arrived on the device in a direct-copy landing slot (sources.direct_copies)
    landing: Any = None  # landed: that slot's owned Region (sources.source), given back once applied
    host_rows: Any = field(default=None, repr=False)  # numpy view of host_hashes


class DeviceCheck:
    """Expected hashes of the spans checked on the device, and each device's scratch ring.

    Only the copy thread uses it. Call order: :meth:`next_slot` (resolve the slot's previous
    batch first if it has one) -> :meth:`stage` on the device's copy stream -> later
    :meth:`mismatch` once the slot's event has completed -> apply ``slot.data`` ->
    ``slot.pieces = []``. A batch holds at most ``max_chunks`` chunks.
    """

    def __init__(
        self, manifest: Manifest, spans: Sequence[LoadSpan], *, slot_bytes: int, slots: int, max_chunks: int = 0
    ) -> None:
        self.chunk_size = manifest.chunk_size
        self.slot_bytes = slot_bytes
        self.max_chunks = max(max_chunks, slot_bytes // self.chunk_size)
        self.slots = max(1, slots)
        self._rows: dict[int, int] = {}  # span index -> its first row in the table
        hexes: list[str] = []
        for ls in spans:
            if ls.checkable or ls.device_check:  # a small checkable span may join a checked batch
                hashes = manifest.storages[ls.index].hashes
                assert hashes is not None
                self._rows[ls.index] = len(hexes)
                hexes += hashes
        self._expected = hex_to_hashes(hexes).numpy()  # (rows, 2) int64, compared on the host
        self._rings: dict[torch.device, list[ScratchSlot]] = {}
        self._turn: dict[torch.device, int] = {}

    def next_slot(self, device: torch.device) -> ScratchSlot:
        """The slot the next piece for ``device`` goes into (its ``piece`` must be resolved first)."""
        ring = self._rings.get(device)
        if ring is None:
            ring = self._rings[device] = [self._new_slot(device) for _ in range(self.slots)]
            self._turn[device] = 0
        turn = self._turn[device]
        self._turn[device] = (turn + 1) % len(ring)
        return ring[turn]

    def _new_slot(self, device: torch.device) -> ScratchSlot:
        pinned = device.type == "cuda"
        n = self.max_chunks
        host = torch.zeros((n, HASH_WORDS), dtype=torch.int64, pin_memory=pinned)
        return ScratchSlot(
            device,
            data=torch.empty(self.slot_bytes, dtype=torch.uint8, device=device),
            hashes=torch.zeros((n, HASH_WORDS), dtype=torch.int64, device=device),
            host_hashes=host,
            pinned=pinned,
            host_rows=host.numpy(),
        )

    def stage(
        self, slot: ScratchSlot, pieces: Sequence[tuple[Piece, int]], region: torch.Tensor, *, pinned_region: bool,
        landed: bool = False,
    ) -> None:
        """Queue, on the current stream: copy the batch's bytes (``region``, each piece at its
        offset; ``pinned_region``: page-locked host memory) into ``slot`` with one copy, hash
        every piece's chunks with one launch, and copy the hashes back to the host.
        ``landed``: ``region`` already is on the slot's device (a direct-copy landing slot):
        hashed where it is, no copy; ``slot.source`` is then ``region`` until resolved."""
        assert not slot.pieces, "resolve the slot's previous batch first"
        end = max(offset + piece.nbytes for piece, offset in pieces)
        total = sum(piece.count for piece, _ in pieces)
        if end > self.slot_bytes or total > self.max_chunks:
            raise CheckpointError(f"a batch of {end} bytes, {total} chunks exceeds a scratch slot")
        if landed:
            source = region
        else:
            source = slot.data
            source[:end].copy_(region[:end], non_blocking=pinned_region)
        slot.source, slot.landed = source, landed
        got = slot.hashes[:total]
        if len(pieces) == 1:
            # one piece (most bytes of a large model): the single-span kernel, no row table;
            # the copy thread's few host calls per piece bound the restore rate (BENCHMARKS.md)
            chunk_hashes(source[: pieces[0][0].nbytes], self.chunk_size, out=got)
        else:
            chunk_hashes_many([source[o : o + p.nbytes] for p, o in pieces], self.chunk_size, got)
        # the whole buffer (a few KiB): no slicing, and rows past the batch are never read
        slot.host_hashes.copy_(slot.hashes, non_blocking=slot.pinned)
        slot.pieces = list(pieces)

    def spans_checked(self) -> frozenset[int]:
        return frozenset(self._rows)

    def mismatch(self, slot: ScratchSlot) -> tuple[Piece, int] | None:
        """The piece of the slot's batch whose chunk failed first, and that chunk's index in
        its span; None if every chunk passed. Call once the slot's event has completed."""
        assert slot.pieces
        row = 0
        for piece, _ in slot.pieces:  # host memory only: numpy, no torch call
            first = self._rows[piece.span.index] + piece.first
            got = slot.host_rows[row : row + piece.count]
            want = self._expected[first : first + piece.count]
            if not np.array_equal(got, want):
                k = int(np.flatnonzero((got != want).any(axis=1))[0])
                return piece, piece.first + k
            row += piece.count
        return None
