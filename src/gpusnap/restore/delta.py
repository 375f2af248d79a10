"""Restore only what changed: the chunks of a checkpoint that differ from the checkpoint
last restored into the same targets (the rounds of a live migration, ``gpusnap.migrate``).

Call order::

    delta = Delta(baseline)                    # Baseline(): nothing restored yet (all moves)
    restorer.restore(repo, manifest, app_state, ..., replan=delta.replan)   # changed chunks only
    baseline = delta.applied()                 # once the restore is complete: what the targets hold
    delta.stats                                # DeltaStats: chunks and bytes moved, of how many

A span's chunk ``j`` is *kept* when the span fills the same tensors, laid out as when the
baseline was restored (same storages, offsets, shapes, strides, dtypes), and the baseline's
chunk ``j`` had the same name. Chunk names are content addresses (BLAKE2b, or the device
hash the saving program computed), so the bytes there already are the new checkpoint's.

What moves, per span: nothing when every chunk is kept; for a streamable span (every target
row-major contiguous, ``RestorePlan.streamable``) each run of consecutive changed chunks, as
a span of its own whose targets are flat byte views of the tensors it overlaps (they share
the tensors' storages, so a lazy restore's gate holds the real tensors); any other span
whole. The restore then runs as usual on that smaller manifest and plan (pipelined, upfront
or lazy, verified as asked); its ``finish()`` is the whole plan's (Stateful values, plain
values). The manifest's recorded access order is carried over to the pieces.

The baseline is sound only while nothing but these restores writes the targets between
them (a migration's target program does not run before the handoff), and it holds a
reference to every target so that no other tensor can take a storage it names.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from gpusnap.restore.lazy.gate import storage_key
from gpusnap.state.plan import RestorePlan
from gpusnap.state.targets import SpanTarget, TensorSpec
from gpusnap.storage.fast_chunks import FastChunks
from gpusnap.storage.manifest import Manifest, StorageEntry

__all__ = ["Baseline", "Delta", "DeltaStats"]


@dataclass(frozen=True)
class DeltaStats:
    """What a delta restore moved: ``spans``/``chunks``/``nbytes`` of the checkpoint, and the
    part of each that was read and written (``*_moved``); ``full``: no baseline applied (the
    first restore, or a layout the baseline does not know)."""

    spans: int = 0
    spans_moved: int = 0
    chunks: int = 0
    chunks_moved: int = 0
    nbytes: int = 0
    bytes_moved: int = 0
    full: bool = True


@dataclass(frozen=True)
class Baseline:
    """What the targets hold: per span layout (:func:`_layout`) the chunk names restored
    there, under ``chunk_size``. ``held``: the targets themselves, kept alive so that their
    storages' identities (which the layouts name) cannot be taken by other tensors."""

    chunk_size: int = 0
    names: dict[Hashable, tuple[str, ...]] = field(default_factory=dict)
    held: tuple[torch.Tensor, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.names


class Delta:
    """One delta restore against ``baseline`` (see the module docstring).

    >>> delta = Delta(Baseline())                                           # doctest: +SKIP
    >>> restorer.restore(repo, m, app_state, allow_pickle=False, lazy=False, verify="auto",
    ...                  started=time.perf_counter(), replan=delta.replan)   # doctest: +SKIP
    >>> baseline = delta.applied()                                          # doctest: +SKIP
    """

    def __init__(self, baseline: Baseline, *, supplied: frozenset[int] = frozenset()) -> None:
        """``supplied``: spans the caller writes into the targets itself (a migration's fast
        handoff): never moved from the checkpoint, whatever their layout."""
        self.baseline = baseline
        self.supplied = supplied
        self.stats = DeltaStats()
        self.relaid_out: tuple[int, ...] = ()
        """Spans whose targets are laid out otherwise than in the baseline (new storages: a
        ``load_state_dict`` that makes fresh tensors, RNG state): moved whole each time."""
        self._full: tuple[Manifest, RestorePlan] | None = None

    def replan(self, manifest: Manifest, plan: RestorePlan) -> tuple[Manifest, RestorePlan]:
        """The manifest and plan of the chunks that changed (``Restorer.restore(replan=...)``)."""
        self._full = (manifest, plan)
        base = self.baseline
        usable = not plan.sharded and base.chunk_size == manifest.chunk_size and not base.empty
        cs = manifest.chunk_size
        entries: list[StorageEntry] = []
        copies: dict[int, list[SpanTarget]] = {}
        paths: dict[int, list[str]] = {}
        pieces: dict[int, list[int]] = {}  # original span -> its pieces in the new manifest
        moved_chunks = moved_bytes = spans_moved = 0
        relaid: list[int] = []
        for i, entry in enumerate(manifest.storages):
            names = tuple(entry.chunks)
            old = base.names.get(_layout(plan, i, entry)) if usable else None
            if usable and old is None:
                relaid.append(i)
            if old == names or i in self.supplied:
                continue
            changed = [j for j in range(len(names)) if old is None or j >= len(old) or old[j] != names[j]]
            spans_moved += 1
            runs = _runs(changed)
            if (len(runs) <= 1 and len(changed) == len(names)) or not plan.streamable(i) \
                    or isinstance(entry.chunks, FastChunks):  # (a fast span's names are runs of slab bytes)
                k = len(entries)
                entries.append(entry)
                copies[k] = [replace(t, spec=replace(t.spec, storage=k)) for t in plan.span_targets(i)]
                paths[k] = list(plan.span_paths.get(i, []))
                pieces[i] = [k]
                moved_chunks += len(names)
                moved_bytes += entry.nbytes
                continue
            for j0, j1 in runs:
                start, stop = j0 * cs, min(j1 * cs, entry.nbytes)
                k = len(entries)
                entries.append(StorageEntry(stop - start, entry.device, names[j0:j1],
                                            None if entry.hashes is None else tuple(entry.hashes[j0:j1])))
                copies[k] = _byte_pieces(plan.span_targets(i), start, stop, k)
                paths[k] = list(plan.span_paths.get(i, []))
                pieces.setdefault(i, []).append(k)
                moved_chunks += j1 - j0
                moved_bytes += stop - start
        self.relaid_out = tuple(relaid)
        self.stats = DeltaStats(
            spans=len(manifest.storages), spans_moved=spans_moved,
            chunks=sum(len(e.chunks) for e in manifest.storages), chunks_moved=moved_chunks,
            nbytes=manifest.nbytes, bytes_moved=moved_bytes, full=not usable,
        )
        stats = dict(manifest.stats)
        order = stats.get("access_order")
        if isinstance(order, list):  # (the program's order of touching buffers, carried to the pieces)
            stats["access_order"] = [k for i in order if type(i) is int for k in pieces.get(i, ())]
        sub = replace(manifest, storages=tuple(entries), stats=stats)
        sub_plan = RestorePlan(
            _Finish(plan), copies, [e.nbytes for e in entries], paths,
            {k for i in plan.stateful_spans for k in pieces.get(i, ())},
            {k for i in plan.read_at_finish for k in pieces.get(i, ())},
        )
        return sub, sub_plan

    def writable_piecewise(self) -> bool:
        """Whether every span of the last plan may be written in byte ranges (streamable, not
        resharded): what a migration's fast handoff needs of the targets."""
        if self._full is None:
            return False
        manifest, plan = self._full
        return not plan.sharded and all(plan.streamable(i) for i in range(len(manifest.storages)))

    def applied(self) -> Baseline:
        """The baseline after this restore completed: every span's chunk names in its targets."""
        if self._full is None:
            raise RuntimeError("Delta.applied() before the restore planned (pass replan=delta.replan)")
        manifest, plan = self._full
        if plan.sharded:  # (box copies of resharded DTensors: every round moves them whole)
            return Baseline()
        names = {_layout(plan, i, e): tuple(e.chunks) for i, e in enumerate(manifest.storages)}
        held = tuple(t for i in range(len(manifest.storages)) for t in plan.targets(i))
        return Baseline(manifest.chunk_size, names, held)


class _Finish:
    """The root slot of a delta's plan: its ``finish()`` is the whole plan's."""

    def __init__(self, plan: RestorePlan) -> None:
        self.plan = plan

    def build(self) -> Any:
        self.plan.finish()


def _layout(plan: RestorePlan, index: int, entry: StorageEntry) -> Hashable:
    """Where span ``index``'s bytes go: its length, and per target the storage (identity),
    the target's place in it and the stored layout. Two restores with equal layouts write
    the same bytes of the same memory."""
    return (entry.nbytes, tuple(
        (storage_key(t.target), t.target.storage_offset(), tuple(t.target.stride()), str(t.target.dtype),
         t.spec.byte_offset, t.spec.shape, t.spec.stride, str(t.spec.dtype), t.src, t.dst)
        for t in plan.span_targets(index)
    ))


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted indices as ``[start, stop)`` runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for j in indices:
        if runs and runs[-1][1] == j:
            runs[-1] = (runs[-1][0], j + 1)
        else:
            runs.append((j, j + 1))
    return runs


def _byte_pieces(targets: Sequence[SpanTarget], start: int, stop: int, k: int) -> list[SpanTarget]:
    """The parts of a streamable span's ``targets`` that its bytes ``[start, stop)`` fill, as
    flat ``uint8`` views (same storage) with specs placing them in span ``k``, that run."""
    out = []
    for t in targets:
        lo, hi = max(start, t.spec.byte_offset), min(stop, t.spec.byte_offset + t.spec.extent)
        if lo >= hi:
            continue
        with torch.inference_mode(False):  # (a view made inside it would be an inference tensor)
            flat = t.target.detach().view(-1).view(torch.uint8)  # contiguous: a view, shares the version
        view = flat[lo - t.spec.byte_offset : hi - t.spec.byte_offset]
        spec = TensorSpec(storage=k, dtype=torch.uint8, shape=(hi - lo,), stride=(1,), byte_offset=lo - start,
                          device=t.spec.device, requires_grad=False)
        out.append(SpanTarget(view, spec, t.path))
    return out
