"""A restore plan (:class:`RestorePlan`): the frozen targets of every span, the books of which
bytes were claimed, and ``finish``. Made by :func:`~gpusnap.state.apply.plan_restore`; the
call order is in that module's docstring.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import torch

from ..errors import CheckpointError
from .slots import Slot
from .targets import ByteTarget, SpanTarget, byte_contiguous

__all__ = ["RestorePlan"]


class RestorePlan:
    """Targets paired with checkpoint spans; see the module docstring for the call order.

    ``span_paths`` names the key paths filled from each span (for error messages).
    ``stateful_spans`` are the spans whose tensors are handed to a Stateful's ``load_state_dict``.
    ``read_at_finish`` is the subset a lazy restore must load before :meth:`finish`: spans whose
    values ``load_state_dict`` may read without an ATen op a dispatch mode would see (RNGState
    does; a module's extra state may). Optimizers are left out: their ``load_state_dict`` only
    keeps the tensor objects, or converts them with ``Tensor.to``, which the lazy gate sees.
    ``missing``, ``unexpected`` and ``unused_spans``: what a ``strict=False`` plan skipped
    (empty otherwise); an unused span is applied as 0 bytes, so a reader reads none of it.
    ``resharded``: DTensors cut from pieces of another layout (box copies: a target may be
    filled from several spans, so such a restore is eager).
    """

    def __init__(
        self,
        root: Slot,
        copies: dict[int, list[SpanTarget]],
        span_nbytes: list[int],
        span_paths: dict[int, list[str]],
        stateful_spans: set[int],
        read_at_finish: set[int] | None = None,
        *,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        unused_spans: frozenset[int] = frozenset(),
        resharded: Sequence[str] = (),
    ) -> None:
        self.span_paths = span_paths
        self.resharded = tuple(resharded)
        self.sharded = bool(resharded)  # some target is a DTensor (set by plan_restore)
        self.missing = tuple(missing)
        self.unexpected = tuple(unexpected)
        self.unused_spans = unused_spans
        self.stateful_spans = frozenset(stateful_spans)
        self.read_at_finish = frozenset(stateful_spans if read_at_finish is None else read_at_finish)
        self._root = root
        self._copies = copies
        self._span_nbytes = span_nbytes
        self._lock = threading.Lock()
        self._applied: set[int] = set()
        self._filled: dict[int, int] = {}  # bytes claimed by claim_range so far, per span
        self._streamable: dict[int, bool] = {}
        self._byte_views: dict[int, tuple[bool, tuple[ByteTarget, ...]]] = {}
        self._finished = False
        # Whether the restore's writes advance the targets' autograd version counters. A lazy
        # restore turns this off: autograd records an op's inputs (and their versions) above
        # the gate, before the op waits there for their bytes, so the restore's own writes
        # would read as in-place changes in backward (LazyRestore sets it; see docs/restore.md).
        self.versioned_writes = True

    @property
    def pending_spans(self) -> frozenset[int]:
        """Span indices not applied yet."""
        with self._lock:
            return frozenset(range(len(self._span_nbytes))) - self._applied

    def span_targets(self, index: int) -> tuple[SpanTarget, ...]:
        """What span ``index`` fills: each target with where its bytes lie in the span."""
        return tuple(self._copies.get(index, ()))

    def targets(self, index: int) -> list[torch.Tensor]:
        """The live tensors span ``index`` fills (a lazy restore gates the program on them)."""
        return [copy.target for copy in self._copies.get(index, ())]

    def devices(self, index: int) -> set[torch.device]:
        """Devices of the tensors span ``index`` fills."""
        return {copy.target.device for copy in self._copies.get(index, ())}

    def streamable(self, index: int) -> bool:
        """Whether span ``index`` may be applied piecewise (``restore.apply_bytes.apply_range``).

        True when every target's bytes are one run of the span's bytes in the same order:
        the checkpoint's layout and the target are both row-major contiguous. Transposed,
        strided or overlapping layouts need the whole span (``apply_span``).
        """
        known = self._streamable.get(index)
        if known is None:
            known = self._streamable[index] = all(
                copy.src is None and byte_contiguous(copy.target, copy.spec) for copy in self._copies.get(index, ())
            )
        return known

    def prepare_byte_views(self, indices: Iterable[int]) -> None:
        """Build the cached aliases of these spans' targets now (see :meth:`byte_targets`).

        The loader calls this on the restoring thread before its readers start: built later,
        on the copy thread, each of the few torch calls per target waits for the GIL against
        the readers, and this work took ~30% of a GPT-2 large restore (BENCHMARKS.md)."""
        for index in indices:
            self.byte_targets(index)

    def forget_byte_views(self) -> None:
        """Drop the cached aliases of the targets (the loader calls this when it stops): they
        would keep storages alive that the program swaps out later (``param.data = ...``)."""
        self._byte_views = {}

    def byte_targets(self, index: int) -> tuple[ByteTarget, ...]:
        """Per target of a :meth:`streamable` span: its byte range in the span and its bytes as
        a flat uint8 alias (:class:`ByteTarget`), where a restore's copies (or the restore
        server, over CUDA IPC) put them. Built once per span and write mode: a restore
        applies a large model's spans in thousands of ranges, on the one thread that bounds
        its rate."""
        cached = self._byte_views.get(index)
        if cached is not None and cached[0] == self.versioned_writes:
            return cached[1]
        views = []
        # Outside inference mode whoever builds them (the restoring thread, which may be in
        # it): a view made inside it is an inference tensor, which the copy thread and the
        # readers could not write. Inference-tensor targets are written under the mode anyway.
        with torch.inference_mode(False):
            for copy in self._copies.get(index, ()):
                spec = copy.spec
                if spec.numel == 0:
                    continue
                dst = copy.writable(self.versioned_writes).view(-1).view(torch.uint8)  # contiguous: views
                views.append(ByteTarget(spec.byte_offset, spec.byte_offset + spec.extent, dst,
                                        copy.target.is_inference(), copy.path))
        frozen = tuple(views)
        self._byte_views[index] = (self.versioned_writes, frozen)
        return frozen

    def finish(self) -> None:
        """Call ``load_state_dict`` on Stateful values and put plain values back; once."""
        with self._lock:
            if self._finished:
                raise CheckpointError("RestorePlan.finish() was already called")
            self._finished = True
        self._root.build()

    def claim_span(self, index: int, data: torch.Tensor) -> None:
        """Count span ``index`` as applied whole from ``data`` (checked: a contiguous 1-D uint8
        tensor of the span's length); CheckpointError if it cannot be, or already was."""
        if not 0 <= index < len(self._span_nbytes):
            raise CheckpointError(f"span {index} does not exist (the checkpoint has {len(self._span_nbytes)})")
        nbytes = self._span_nbytes[index]
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != nbytes or data.stride(0) != 1:
            raise CheckpointError(
                f"span {index}: expected a contiguous 1-D uint8 tensor of {nbytes} bytes, got "
                f"{data.dtype} of shape {list(data.shape)}"
            )
        with self._lock:
            if index in self._applied or index in self._filled:
                raise CheckpointError(f"span {index} was already applied")
            self._applied.add(index)

    def claim_range(self, index: int, offset: int, data: torch.Tensor) -> None:
        """Count ``data``'s bytes at ``offset`` of span ``index`` as applied (ranges of a
        :meth:`streamable` span, any order, from several threads; the span counts as applied
        once they cover it); CheckpointError for a range outside it, or too many bytes."""
        if not 0 <= index < len(self._span_nbytes):
            raise CheckpointError(f"span {index} does not exist (the checkpoint has {len(self._span_nbytes)})")
        nbytes = self._span_nbytes[index]
        if data.dtype != torch.uint8 or data.dim() != 1 or data.stride(0) != 1:
            raise CheckpointError(f"span {index}: expected a contiguous 1-D uint8 tensor, got {data.dtype}")
        if offset < 0 or offset + data.numel() > nbytes:
            raise CheckpointError(f"span {index}: bytes [{offset}, {offset + data.numel()}) lie outside its {nbytes}")
        if not self.streamable(index):
            raise CheckpointError(f"span {index} has targets that need the whole span: use apply_span")
        with self._lock:
            if index in self._applied:
                raise CheckpointError(f"span {index} was already applied")
            filled = self._filled.get(index, 0) + data.numel()
            if filled > nbytes:
                raise CheckpointError(f"span {index}: more bytes applied than it holds ({filled} > {nbytes})")
            self._filled[index] = filled
            if filled == nbytes:
                self._applied.add(index)
