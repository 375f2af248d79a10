"""The target's part of a fast handoff: check the changed chunks, then write them in place.

The target has applied the round the delta is based on (``header.base``). It restores that
round's manifest with the handoff's tree through the restorer as usual, with
:meth:`DeltaApply.replan` as the replan: against the baseline every chunk is kept (nothing
is read from the transport), so the restore's own work is its checks and ``finish()`` (plain
values, Stateful values); the replan itself writes the delta. Before any byte is written it
checks that the state is laid out as the base round's (same spans, no span of the base moved
again, every changed span writable piecewise) and that every chunk matches its digest, on
the device its bytes go to where it is a CUDA device (one host-to-device copy per device,
one hash launch), else on the host.

>>> apply = DeltaApply(header, data_path, Delta(baseline))                     # doctest: +SKIP
>>> restorer.restore(repo, replace(base, tree=header.tree), app_state, allow_pickle=False,
...                  lazy=False, verify="off", started=t0, replan=apply.replan)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence

import torch

from gpusnap.errors import CheckpointError
from gpusnap.kernels.chunk_hash import HASH_WORDS, hex_rows, num_chunks
from gpusnap.kernels.chunk_hash_many import chunk_hashes_many
from gpusnap.migrate.delta_file import POPULATE, DeltaHeader, DeltaRun, mapped_bytes, unmap
from gpusnap.migrate.state_digests import blake_hex
from gpusnap.restore.apply_bytes import apply_ranges
from gpusnap.restore.delta import Delta
from gpusnap.state.plan import RestorePlan
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.private_dir import open_private

__all__ = ["DeltaApply"]


class DeltaApply:
    """One fast handoff's delta, applied by :meth:`replan` (see the module docstring).
    ``written``: whether any byte may have been written (for the error a failure gives);
    ``bytes_moved``/``chunks_moved`` once applied."""

    def __init__(self, header: DeltaHeader, data_path: str, delta: Delta,
                 premapped: tuple[torch.Tensor, bool] | None = None) -> None:
        """``premapped``: the bytes file's first ``header.nbytes`` already mapped (delta_premap.py)
        and whether that mapping is page-locked; None: mapped here."""
        self.header = header
        self.data_path = data_path
        self.delta = delta
        self.premapped = premapped
        self.written = False
        self.bytes_moved = sum(r.stop - r.start for r in header.runs)
        self.chunks_moved = sum(len(r.digests) for r in header.runs)

    def replan(self, manifest: Manifest, plan: RestorePlan) -> tuple[Manifest, RestorePlan]:
        header = self.header
        if plan.sharded:
            raise CheckpointError("the handoff delta cannot land in resharded (DTensor) targets")
        have = tuple(e.nbytes for e in manifest.storages)
        if have != header.spans:
            raise CheckpointError(f"the handoff delta's state has {len(header.spans)} spans, round {header.base} "
                                  f"{len(have)} (or of other lengths): laid out otherwise")
        sub = self.delta.replan(manifest, plan)
        if self.delta.stats.spans_moved:
            raise CheckpointError(f"{self.delta.stats.spans_moved} span(s) of app_state are laid out otherwise than "
                                  f"when round {header.base} was applied")
        for r in header.runs:
            if not plan.streamable(r.span):
                raise CheckpointError(f"span {r.span} ({', '.join(plan.span_paths.get(r.span, [])[:2])}) is not "
                                      "row-major contiguous here: the handoff delta cannot be written piecewise")
        if self.premapped is not None:
            (host, locked), mapped = self.premapped, None
        else:
            (host, mapped), locked = _map(self.data_path, header.nbytes), False
        staged: dict[torch.device, tuple[torch.Tensor, int]] = {}
        try:
            groups = _groups(header.runs, plan)
            staged.update((device, _stage(host, runs, device, locked)) for device, runs in groups.items())
            for device, runs in groups.items():
                _check(runs, staged[device], header.chunk_size)
            self.written = True
            for device, runs in groups.items():
                data, base = staged[device]
                apply_ranges(plan, [(r.span, r.start, r.offset - base, r.stop - r.start) for r in runs], data,
                             non_blocking=False)
        finally:
            for device, (data, _) in staged.items():
                if data.is_cuda:  # (before the staging goes; after a failure, a copy from the mapping may be in flight)
                    torch.cuda.current_stream(device).synchronize()
            staged.clear()
            del host
            unmap(mapped)
        return sub


def _map(path: str, nbytes: int) -> tuple[torch.Tensor, mmap.mmap]:
    """The first ``nbytes`` of the bytes file, mapped read-only. Shared, not private: a
    private writable mapping populated up front copies every page (its copy-on-write broken
    at once), and nothing is checked in the mapping itself (``_stage`` copies first)."""
    fd = open_private(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise CheckpointError(f"the handoff's bytes file holds {size} bytes, its header names {nbytes}")
        mapped = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED | POPULATE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return mapped_bytes(mapped)[:nbytes], mapped


def _groups(runs: Sequence[DeltaRun], plan: RestorePlan) -> dict[torch.device, list[DeltaRun]]:
    """Runs by where their bytes are staged: the CUDA device all their targets are on, else
    the host (CPU targets, or targets on several devices)."""
    out: dict[torch.device, list[DeltaRun]] = {}
    cpu = torch.device("cpu")
    for r in runs:
        devices = plan.devices(r.span)
        device = next(iter(devices)) if len(devices) == 1 else cpu
        out.setdefault(device if device.type == "cuda" else cpu, []).append(r)
    return out


def _stage(host: torch.Tensor, runs: Sequence[DeltaRun], device: torch.device,
           page_locked: bool) -> tuple[torch.Tensor, int]:
    """The bytes of ``runs`` where they are checked and copied from, and the file offset its
    index 0 stands for: one copy of their extent on ``device`` (asynchronous from page-locked
    memory: the check on the same stream waits for it) or in private host memory, so that
    the bytes checked are the bytes written whatever happens to the file meanwhile."""
    lo = min(r.offset for r in runs)
    hi = max(r.offset + (r.stop - r.start) for r in runs)
    if device.type != "cuda":
        return host[lo:hi].clone(), lo
    with torch.cuda.device(device):
        data = torch.empty(hi - lo, dtype=torch.uint8, device=device)
        data.copy_(host[lo:hi], non_blocking=page_locked)
    return data, lo


def _check(runs: Sequence[DeltaRun], staged: tuple[torch.Tensor, int], chunk_size: int) -> None:
    """Every chunk of ``runs`` against its digest: device hashes where they are staged (one
    launch), BLAKE2b on the host (of the staged copy). CheckpointError naming the first that differs."""
    data, base = staged
    hashed = [r for r in runs if r.kind == "nh"]
    if hashed:
        views = [data[r.offset - base : r.offset - base + (r.stop - r.start)] for r in hashed]
        out = torch.empty((sum(num_chunks(v.numel(), chunk_size) for v in views), HASH_WORDS), dtype=torch.int64,
                          device=data.device)
        with torch.cuda.device(data.device) if data.is_cuda else contextlib.nullcontext():
            chunk_hashes_many(views, chunk_size, out)
        got = hex_rows(out.cpu().numpy())
        want = [d for r in hashed for d in r.digests]
        _compare(hashed, got, want)
    blaked = [r for r in runs if r.kind == "b2"]
    for r in blaked:
        part = data[r.offset - base : r.offset - base + (r.stop - r.start)]
        _compare([r], blake_hex(part.cpu() if part.is_cuda else part, chunk_size), list(r.digests))


def _compare(runs: Sequence[DeltaRun], got: list[str], want: list[str]) -> None:
    if got == want:
        return
    at = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    for r in runs:
        if at < len(r.digests):
            raise CheckpointError(f"chunk {at} of the handoff delta's run at byte {r.start} of span {r.span} does "
                                  "not match its digest: the handoff's bytes file is damaged")
        at -= len(r.digests)
    raise CheckpointError("the handoff delta's digests do not match its chunks")
