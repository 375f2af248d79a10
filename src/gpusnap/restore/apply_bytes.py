"""Restored bytes into their targets: the copies behind every restore path.

``state.RestorePlan`` says where each span's bytes go (frozen ``SpanTarget`` / ``ByteTarget``)
and keeps the books (``claim_span`` / ``claim_range``: each byte applied once); this module
moves them::

    apply_span(plan, i, data)              # a whole span, any layout (box copies too)
    apply_range(plan, i, offset, data)     # part of a streamable span (a restore's piece)
    apply_ranges(plan, ranges, data, ...)  # several ranges of one buffer in one torch call
    apply_all(plan, {i: data})             # every span, then plan.finish()

Tensors are filled bitwise through an integer view of the same item size, so every dtype
(float8, bits, bool, complex...) and every NaN payload survives exactly. A copy from pinned
host memory to a device is queued on the current stream: keep the source unchanged until
that stream has passed this point.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from gpusnap.errors import CheckpointError
from gpusnap.state.plan import RestorePlan
from gpusnap.state.targets import TensorSpec

__all__ = ["apply_all", "apply_range", "apply_ranges", "apply_span", "copy_batch", "copy_bytes"]

# Copying through an integer dtype of the same width moves bits, never values.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def apply_span(plan: RestorePlan, index: int, data: torch.Tensor) -> None:
    """Fill every target on span ``index`` from ``data`` (uint8, the span's nbytes, any device).

    When ``data`` is pinned host memory and a target is on a device, the copy is queued
    on the current stream: keep ``data`` unchanged until that stream has passed this point.
    """
    plan.claim_span(index, data)
    for copy in plan.span_targets(index):
        try:
            copy_into(copy.writable(plan.versioned_writes), copy.target.is_inference(), data, copy.spec,
                      src=copy.src, dst=copy.dst)
        except Exception as exc:
            raise CheckpointError(f"{copy.path}: copying the restored bytes failed: {exc!r}") from exc


def apply_range(plan: RestorePlan, index: int, offset: int, data: torch.Tensor, *,
                non_blocking: bool | None = None) -> None:
    """Fill the targets' bytes that span ``index`` holds in ``[offset, offset + len(data))``.

    Ranges of one span may come in any order and from several threads; once they cover
    the span it counts as applied. Only for ``plan.streamable`` spans. Like
    :func:`apply_span`, a copy from pinned memory to a device is queued on the current
    stream: keep ``data`` unchanged until that stream has passed this point.
    ``non_blocking``: whether host ``data`` is pinned, when the caller knows (None: ask).
    """
    plan.claim_range(index, offset, data)
    if non_blocking is None:
        non_blocking = data.device.type == "cpu" and data.is_pinned()
    for dst, src, inference, path in _range_copies(plan, index, offset, data):
        try:
            copy_bytes(dst, src, inference, non_blocking)
        except Exception as exc:
            raise CheckpointError(f"{path}: copying the restored bytes failed: {exc!r}") from exc


def apply_ranges(plan: RestorePlan, ranges: Sequence[tuple[int, int, int, int]], data: torch.Tensor, *,
                 non_blocking: bool) -> None:
    """:func:`apply_range` for several ranges of one buffer at once: ``(index, offset, at,
    nbytes)`` fills span ``index``'s bytes ``[offset, offset + nbytes)`` with
    ``data[at : at + nbytes]``. ``data`` is a restore's host region or device scratch;
    ``non_blocking``: it is pinned host memory. All copies are queued by one call
    (``torch._foreach_copy_``: one kernel for device-to-device), as a batch of small spans
    would otherwise cost a Python round of torch calls per tensor. If that call fails, the
    ranges are copied one by one, so an error names its tensor; its ``ranges_written``
    attribute counts the ranges before it, which are written. (Every range is claimed
    before the first copy: after an error the plan is spent.)"""
    pairs: list[tuple[int, torch.Tensor, torch.Tensor, bool, str]] = []
    for r, (index, offset, at, nbytes) in enumerate(ranges):
        piece = data[at : at + nbytes]
        plan.claim_range(index, offset, piece)
        pairs += [(r, *copy) for copy in _range_copies(plan, index, offset, piece)]
    try:
        for inference in (False, True):
            group = [(d, s) for _, d, s, inf, _ in pairs if inf is inference]
            if group:
                copy_batch([d for d, _ in group], [s for _, s in group], inference, non_blocking)
    except Exception:
        for r, dst, src, inference, path in pairs:  # one by one: the error names the tensor
            try:
                copy_bytes(dst, src, inference, non_blocking)
            except Exception as exc:
                error = CheckpointError(f"{path}: copying the restored bytes failed: {exc!r}")
                error.ranges_written = r  # type: ignore[attr-defined]
                raise error from exc


def apply_all(plan: RestorePlan, span_data: Mapping[int, torch.Tensor]) -> None:
    """:func:`apply_span` for every span in ``span_data``, then ``plan.finish()``."""
    missing = plan.pending_spans - set(span_data)
    if missing:
        raise CheckpointError(f"RestorePlan.apply: no data for span(s) {sorted(missing)}")
    for index, data in span_data.items():
        apply_span(plan, index, data)
    plan.finish()


def _range_copies(plan: RestorePlan, index: int, offset: int,
                  data: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, bool, str]]:
    """(target bytes, source bytes, inference target, path) for the targets that span
    ``index``'s bytes ``[offset, offset + len(data))`` overlap."""
    end = offset + data.numel()
    out = []
    for t in plan.byte_targets(index):
        start, stop = t.start, t.stop
        lo, hi = max(offset, start), min(end, stop)
        if lo >= hi:
            continue
        whole_dst = lo == start and hi == stop
        whole_src = lo == offset and hi == end
        out.append((
            t.dst if whole_dst else t.dst[lo - start : hi - start],
            data if whole_src else data[lo - offset : hi - offset],
            t.inference,
            t.path,
        ))
    return out


def copy_into(dest: torch.Tensor, inference: bool, data: torch.Tensor, spec: TensorSpec, *,
              src: tuple[slice, ...] | None = None, dst: tuple[slice, ...] | None = None) -> None:
    """Bitwise ``dest[...] = span bytes`` through integer views (``dest``: a target's writable
    alias, ``SpanTarget.writable``); works for strided targets. ``src``/``dst``: a box copy,
    ``dest[dst] = stored[src]``."""
    if spec.numel == 0:
        return
    source = _source_view(data, spec)
    target = _int_view(dest)
    if src is not None and dst is not None:
        source, target = source[src], target[dst]
    non_blocking = source.device.type == "cpu" and target.device.type != "cpu" and source.is_pinned()
    copy_bytes(target, source, inference, non_blocking)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor, inference: bool, non_blocking: bool) -> None:
    """``dst`` (a detached or ``.data`` alias: autograd never records the write) from ``src``."""
    with inference_guard(inference):
        dst.copy_(src, non_blocking=non_blocking)


def copy_batch(dsts: list[torch.Tensor], srcs: list[torch.Tensor], inference: bool, non_blocking: bool) -> None:
    """:func:`copy_bytes` for many pairs in one call (one kernel for device-to-device)."""
    with inference_guard(inference):
        torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)


def inference_guard(inference: bool) -> AbstractContextManager[Any]:
    """Inference tensors may only be written inside inference mode; others need no mode (the
    restore writes through detached aliases, which autograd never records)."""
    return torch.inference_mode() if inference else contextlib.nullcontext()


def _int_view(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.element_size() == 16:  # complex128: two int64 lanes per element
        return torch.view_as_real(tensor).view(torch.int64)
    return tensor.view(_INT_OF_SIZE[tensor.element_size()])


def _source_view(data: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The tensor's bytes within ``data``, seen as the integer layout :func:`_int_view` gives."""
    raw = data[spec.byte_offset : spec.byte_offset + spec.extent]
    item = spec.itemsize
    if raw.storage_offset() % item or raw.data_ptr() % item:
        raw = raw.clone()  # views of mixed dtypes can leave this one unaligned in the span
    if item == 16:
        flat = raw.view(torch.int64)
        return flat.as_strided(spec.shape + (2,), tuple(2 * s for s in spec.stride) + (1,))
    return raw.view(_INT_OF_SIZE[item]).as_strided(spec.shape, spec.stride)
