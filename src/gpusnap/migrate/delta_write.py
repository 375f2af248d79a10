"""The source's part of a fast handoff: the changed chunks into the bytes file, their header.

>>> header = write_delta(buffer, flat, runs, now, token=t, base=round_id, seq=7)  # doctest: +SKIP
>>> transport.write_json(backend, DELTA_HEADER, header.to_doc())                  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from gpusnap.kernels.chunk_hash import hex_rows
from gpusnap.migrate.delta_file import ALIGN, DeltaBuffer, DeltaHeader, DeltaRun
from gpusnap.migrate.state_digests import Digests, Run
from gpusnap.state.flat import FlatState

__all__ = ["delta_bytes", "write_delta"]


def _places(runs: Sequence[Run]) -> tuple[list[int], int]:
    offsets, at = [], 0
    for r in runs:
        offsets.append(at)
        at += -(-(r.stop - r.start) // ALIGN) * ALIGN
    return offsets, at


def delta_bytes(runs: Sequence[Run]) -> int:
    """The bytes file's share ``runs`` take (each run aligned)."""
    return _places(runs)[1]


def write_delta(buffer: DeltaBuffer, flat: FlatState, runs: Sequence[Run], now: Digests, *, token: str, base: str,
                seq: int) -> DeltaHeader:
    """Copy ``runs`` of ``flat``'s spans into ``buffer`` (ready, large enough: the caller
    checked :func:`delta_bytes`) and return their header; the copies have completed."""
    view = buffer.view
    assert view is not None
    offsets, total = _places(runs)
    if total > buffer.capacity:
        raise ValueError(f"a delta of {total} bytes does not fit the {buffer.capacity} byte handoff buffer")
    devices: set[torch.device] = set()
    for r, at in zip(runs, offsets):
        src = flat.spans[r.span].as_bytes()[r.start : r.stop]
        dst = view[at : at + (r.stop - r.start)]
        if src.is_cuda:
            devices.add(src.device)
            dst.copy_(src, non_blocking=buffer.page_locked)
        else:
            dst.copy_(src)
    digests = _run_digests(runs, now)
    for device in devices:  # (the device hashes above waited for nothing the copies need)
        torch.cuda.current_stream(device).synchronize()
    buffer.flush(total)
    spans = tuple(sp.nbytes for sp in flat.spans)
    out = tuple(DeltaRun(r.span, r.start, r.stop, at, kind, d) for r, at, (kind, d) in zip(runs, offsets, digests))
    return DeltaHeader(token, base, seq, now.chunk_size, spans, out, flat.tree, os.path.basename(buffer.path), total)


def _run_digests(runs: Sequence[Run], now: Digests) -> list[tuple[str, tuple[str, ...]]]:
    """Per run, its kind of digest and one hex digest per chunk: the device hashes of all
    CUDA runs of a device come to the host in one copy."""
    cs = now.chunk_size
    out: list[tuple[str, tuple[str, ...]] | None] = [None] * len(runs)
    by_device: dict[torch.device, list[int]] = {}
    for k, r in enumerate(runs):
        rows = now.rows[r.span]
        j0, j1 = r.start // cs, -(-r.stop // cs)
        if rows.is_cuda:
            by_device.setdefault(rows.device, []).append(k)
        else:  # BLAKE2b digests, kept as their bytes
            raw = np.ascontiguousarray(rows[j0:j1].numpy()).tobytes().hex()
            out[k] = ("b2", tuple(raw[i : i + 32] for i in range(0, len(raw), 32)))
    for device, ks in by_device.items():
        parts = [now.rows[runs[k].span][runs[k].start // cs : -(-runs[k].stop // cs)] for k in ks]
        text = hex_rows(torch.cat(parts).cpu().numpy())
        at = 0
        for k, part in zip(ks, parts):
            n = part.shape[0]
            out[k] = ("nh", tuple(text[at : at + n]))
            at += n
    return [o for o in out if o is not None]
