"""Load a checkpoint without a template: :func:`load` (``gpusnap.load``).

Restore pairs the manifest's tree with a live ``app_state``; here nothing is live, so the
checkpoint's structure alone decides what comes back: a nested dict in which every module
and Stateful entry is its state_dict, as ``Checkpointer.save`` flattened it (module entries
as ``model.state_dict()`` would give them, detached; an optimizer's ``state`` and
``param_groups``; an RNGState's generator states), tensors and plain values as saved.

Call order::

    repo.resolve_reporting(ref)          # the manifest: id, tag or None (latest)
    Planner walk (TemplateFree)          # tree decoded by state.apply; keys selected; no byte read
    restore.eager.load_spans(cut, plan)  # the selected spans' chunks only, each one verified
    root.build()                         # tensors as views of their spans' bytes

It reuses the restore machinery rather than its own decoding: the tree is walked by
:class:`~gpusnap.state.apply.Planner` (its ``in_state`` path, where the checkpoint's
structure wins), plain values are decoded by it (``pickle`` nodes refused unless
``allow_pickle``), and chunks are read and checked by :func:`~gpusnap.restore.eager.load_spans`
(every chunk of a selected span verified before anything is returned: a corrupt one is an
:class:`~gpusnap.IntegrityError`). What differs: instead of one new tensor per node
(``state.targets.allocate``), each stored span becomes one buffer on ``device`` and every
tensor node a view of it, so views and tied weights come back sharing storage, with their
strides, offsets and dtypes exactly as saved.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from gpusnap.config import Config
from gpusnap.errors import CheckpointError
from gpusnap.restore.eager import load_spans
from gpusnap.restore.key_select import KeyPath, Selector, ambiguity, covers, leads_to, match, normalize
from gpusnap.restore.rank_view import rank_view
from gpusnap.restore.restorer import reader_threads
from gpusnap.state.apply import Planner
from gpusnap.state.dtensor import slices
from gpusnap.state.nodes import node_child, node_kind
from gpusnap.state.plain import join_path
from gpusnap.state.plan import RestorePlan
from gpusnap.state.reshard import DTensorNode
from gpusnap.state.slots import DictSlot, Slot
from gpusnap.state.targets import SpanInfo, TensorSpec
from gpusnap.storage.repository import Repository

__all__ = ["UnknownKeyError", "load", "load_reporting"]


class UnknownKeyError(CheckpointError, KeyError):
    """A ``keys`` prefix names nothing in the checkpoint (the message lists its top-level keys)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


def load(
    root: str | os.PathLike[str],
    checkpoint: str | None = None,
    *,
    keys: Sequence[Selector] | str | None = None,
    device: torch.device | str = "cpu",
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
    config: Config | None = None,
) -> dict[str, Any]:
    """The checkpoint's nested dict of tensors and plain values, without a template.

    ``root``: a durable root or a fast tier's root. ``checkpoint``: an id, a tag, or None for
    the newest committed one (:class:`~gpusnap.CheckpointNotFoundError` if there is none).
    ``keys``: the entries to return (only their chunks are read), each a dotted string
    (``"model"``, ``"optim.state"``, ``"model.0.weight"``; ``/`` separates too) or a tuple of
    keys compared by value and type (``("optim", "state", 0)``, ``("a/b",)``), which can name
    any key; syntax in :mod:`gpusnap.restore.key_select`. A selector naming nothing raises
    :class:`UnknownKeyError` (a KeyError and a CheckpointError) listing the top-level keys; a
    string naming several entries (int ``1`` and str ``"1"``) raises
    :class:`~gpusnap.restore.key_select.AmbiguousKeyError`; an empty ``keys`` is a ValueError.
    ``device``: where tensors are allocated.
    ``allow_pickle``: plain values stored with pickle are refused without it (unpickling can
    run code from the checkpoint). Every chunk read is checked against its digest
    (:class:`~gpusnap.IntegrityError`).

    >>> import tempfile, torch, gpusnap
    >>> root = tempfile.mkdtemp()
    >>> model = torch.nn.Linear(4, 2)
    >>> app_state = {"model": model, "optim": torch.optim.AdamW(model.parameters()), "step": 3}
    >>> with gpusnap.Checkpointer(root) as ckpt:
    ...     _ = ckpt.save(app_state, tag="first").wait()
    >>> sd = gpusnap.load(root)
    >>> sorted(sd), sd["step"], sorted(sd["model"])
    (['model', 'optim', 'step'], 3, ['bias', 'weight'])
    >>> torch.equal(sd["model"]["weight"], model.weight)
    True
    >>> list(gpusnap.load(root, "first", keys=["model"]))
    ['model']
    >>> list(gpusnap.load(root, keys=[("model", "bias")])["model"])
    ['bias']
    """
    return load_reporting(root, checkpoint, keys=keys, device=device, allow_pickle=allow_pickle,
                          storage_options=storage_options, config=config)


def load_reporting(
    root: str | os.PathLike[str],
    checkpoint: str | None = None,
    *,
    keys: Sequence[Selector] | str | None = None,
    device: torch.device | str = "cpu",
    allow_pickle: bool = False,
    storage_options: dict[str, Any] | None = None,
    config: Config | None = None,
    progress: Callable[[int], Callable[[int], None]] | None = None,
) -> dict[str, Any]:
    """:func:`load`, telling ``progress`` (``gpusnap.export``'s) the bytes of the selected
    spans once they are known, then the bytes read and verified as they come."""
    target = torch.device(device)
    selectors = normalize(keys)
    repo = Repository.open(root, storage_options=storage_options, config=config)
    try:
        manifest, skipped = repo.resolve_reporting(checkpoint)
        repo.warn_unreadable(skipped, f"load() used the older checkpoint {manifest.id} instead")
        if manifest.ranks:  # distributed: rank 0's state, its DTensors whole (docs/distributed.md)
            repo, manifest = rank_view(repo, manifest, rank=0, world_size=1)
        planner = _TemplateFree([SpanInfo(nbytes=e.nbytes, device=e.device) for e in manifest.storages], allow_pickle)
        slot = planner.select(manifest.tree, selectors, f"checkpoint {manifest.id} of {repo.root}")
        # Spans nobody selected are cut to nothing: load_spans then reads no chunk of theirs.
        cut = manifest.without_data(set(range(len(manifest.storages))) - planner.wanted)
        landing = _Landing(slot, planner, [e.nbytes for e in cut.storages], target)
        advance = None if progress is None else progress(sum(e.nbytes for e in cut.storages))
        with ThreadPoolExecutor(reader_threads(repo.config.io_threads), thread_name_prefix="gpusnap-load-io") as pool:
            load_spans(repo, cut, landing, pool=pool, apply=landing.keep_span, progress=advance)
        result = slot.build()
    finally:
        repo.close()
    assert isinstance(result, dict)
    return result


class _TemplateFree(Planner):
    """The restore planner with nothing live: modules and Stateful values become their state
    dicts, tensors views of their span's buffer (``spans``, filled once the chunks are read)."""

    def __init__(self, spans: Sequence[SpanInfo], allow_pickle: bool) -> None:
        super().__init__(spans, allow_pickle)
        self.buffers: dict[int, torch.Tensor] = {}  # span -> its bytes on the target device
        self.wanted: set[int] = set()  # spans some selected tensor views
        self._in_module = 0  # inside a module's entries: detached, as state_dict() gives them

    def select(self, tree: dict[str, Any], selectors: tuple[Selector, ...] | None, where: str) -> Slot:
        """The slot of what ``selectors`` select (everything when None); UnknownKeyError or
        AmbiguousKeyError for a selector naming no entry or (a string) several."""
        if node_kind(tree, "") != "dict":
            raise CheckpointError("the checkpoint tree must be a 'dict' node at its root")
        if selectors is None:
            return DictSlot(None, [(k, self.in_state(None, n, join_path("", k))) for k, n in self.keyed(tree, "")])
        chosen: list[KeyPath] = []
        unknown: list[Selector] = []
        for selector in selectors:
            found = match(selector, tree, self.children)
            if len(found) > 1:
                raise ambiguity(selector, found, where)
            chosen += found
            unknown += [] if found else [selector]
        if unknown:
            top = [key for key, _ in self.keyed(tree, "")]
            raise UnknownKeyError(f"keys {unknown!r} name nothing in {where}; its top-level keys are {top!r}")
        return self.pick(tree, "", (), chosen) or DictSlot(None, [])

    def children(self, node: dict[str, Any], path: str) -> list[tuple[Any, dict[str, Any], str]] | None:
        """The keyed entries selection can descend into: a dict's, a module's state_dict
        entries, a Stateful's state_dict (when it is a dict); None for anything else."""
        kind = node_kind(node, path)
        if kind == "module":
            node = node_child(node, "entries", path)
        elif kind == "stateful":
            node = node_child(node, "state", path)
        elif kind != "dict":
            return None
        if node_kind(node, path) != "dict":
            return None
        return [(key, child, join_path(path, key)) for key, child in self.keyed(node, path)]

    def pick(self, node: dict[str, Any], path: str, at: KeyPath, chosen: list[KeyPath]) -> Slot | None:
        """The slot of what is chosen at or below ``node`` (key path ``at``), or None."""
        if at and covers(chosen, at):
            return self.in_state(None, node, path)
        if at and not leads_to(chosen, at):
            return None
        items = self.children(node, path)
        if items is None:
            return None
        module = node_kind(node, path) == "module"
        self._in_module += module
        try:
            picked = [(key, self.pick(child, child_path, at + ((type(key), key),), chosen))
                      for key, child, child_path in items]
        finally:
            self._in_module -= module
        kept = [(key, slot) for key, slot in picked if slot is not None]
        return DictSlot(None, kept) if kept else None

    def object(self, live: Any, node: dict[str, Any], path: str) -> Slot:
        if node["t"] == "module":
            self._in_module += 1
            try:
                return self.in_state(None, node_child(node, "entries", path), path)
            finally:
                self._in_module -= 1
        return self.in_state(None, node_child(node, "state", path), path)

    def tensor_in_state(self, current: Any, node: dict[str, Any], path: str) -> Slot:
        spec = self.spec(node, path)
        self.span_paths[spec.storage].append(path)
        self.wanted.add(spec.storage)
        return _View(self.buffers, spec, spec.requires_grad and not self._in_module)


    def dtensor_target(self, live: Any, node: dict[str, Any], path: str, *, allocate: bool) -> Slot:
        d = self.dnode(node, path)
        if not d.pieces:
            raise CheckpointError(
                f"{path or '<root>'}: {d.describe()} cannot be assembled into one tensor (Partial and "
                "_StridedShard are restored only into the layout they were saved with: use Checkpointer.restore)"
            )
        for piece in d.pieces:
            self.span_paths[piece.spec.storage].append(path)
            self.wanted.add(piece.spec.storage)
        return _Assembled(self.buffers, d, not self._in_module)


@dataclass
class _Assembled:
    """A DTensor node: its global tensor, from the pieces the ranks stored."""

    buffers: dict[int, torch.Tensor]
    node: DTensorNode
    requires_grad: bool

    def build(self) -> torch.Tensor:
        d = self.node
        views = [_View(self.buffers, p.spec, self.requires_grad).build() for p in d.pieces]
        whole = ((0,) * len(d.shape), d.shape)
        if len(views) == 1 and d.pieces[0].box == whole:
            return views[0]
        tensor = torch.empty(d.shape, dtype=d.dtype, device=views[0].device)
        with torch.no_grad():
            for piece, view in zip(d.pieces, views):
                tensor[slices(piece.box, whole)] = view
        if self.requires_grad and views[0].requires_grad:
            tensor.requires_grad_(True)
        return tensor


@dataclass
class _View:
    """A tensor node: a view of its span's buffer, made once the buffer is filled."""

    buffers: dict[int, torch.Tensor]
    spec: TensorSpec
    requires_grad: bool

    def build(self) -> torch.Tensor:
        spec = self.spec
        buffer = self.buffers[spec.storage]
        offset = spec.byte_offset + buffer.storage_offset()  # (uint8: the buffer's own start, in bytes)
        if offset % spec.itemsize:  # (views of mixed dtypes) an offset this dtype cannot address: copied out
            buffer, offset = buffer[spec.byte_offset : spec.byte_offset + spec.extent].clone(), 0
        tensor = torch.empty(0, dtype=spec.dtype, device=buffer.device)
        tensor.set_(buffer.untyped_storage(), offset // spec.itemsize, spec.shape, spec.stride)
        if self.requires_grad and (spec.dtype.is_floating_point or spec.dtype.is_complex):
            tensor.requires_grad_(True)
        return tensor


class _Landing(RestorePlan):
    """What :func:`load_spans` applies the verified spans to: each span's bytes are kept as
    the buffer its tensors view (CPU: the very buffer read into, no copy)."""

    def __init__(self, root: Slot, planner: _TemplateFree, span_nbytes: list[int], device: torch.device) -> None:
        super().__init__(root, {}, span_nbytes, planner.span_paths, set())
        self._buffers = planner.buffers
        self._device = device

    def keep_span(self, index: int, data: torch.Tensor) -> None:
        """Span ``index``'s verified bytes become the buffer its tensors view."""
        self.claim_span(index, data)
        self._buffers[index] = data if data.device == self._device else data.to(self._device)
