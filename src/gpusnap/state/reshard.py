"""Planning the restore of a DTensor (a ``dtensor`` node, state/dtensor.py) into what
app_state holds: part of :class:`~gpusnap.state.apply.Planner`.

- A DTensor laid out as saved (same placements, mesh shape and local shape) takes its own
  rank's local tensor in place: an ordinary copy, bit-exact, streamable, lazy-capable.
- Another layout (world size, mesh or placements) is cut from the pieces every rank stored
  (``Shard``/``Replicate`` only): each piece that meets this rank's box of the global tensor
  is copied into it (a *box copy*, of whole spans); the pieces must cover the box.
- A plain tensor of the global shape takes the whole tensor (restoring a sharded checkpoint
  into one process); a plain ``tensor`` node into a DTensor gives each rank its box (a
  per-process checkpoint into a sharded model).
- ``Partial`` or ``_StridedShard`` in another layout: a mismatch naming the key.

Every path writes into the target's local tensor, never re-wraps it: the DTensor, its
parameter and FSDP2's storage stay the objects the program holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError
from .dtensor import Box, box_of, encode_placements, intersect, is_dtensor, reshardable, slices, volume
from .plain import dtype_from_name, dtype_name
from .slots import Slot, Value
from .targets import TensorSpec, device_here

__all__ = ["DTensorNode", "ReshardPlanning"]


@dataclass(frozen=True)
class Piece:
    box: Box
    spec: TensorSpec


@dataclass(frozen=True)
class DTensorNode:
    """A checked ``dtensor`` node: the global tensor, how it was laid out, and what of it the
    checkpoint holds for this rank (``own``) and for anyone (``pieces``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    placements: list[str]
    mesh: tuple[int, ...]
    own: TensorSpec | None
    pieces: tuple[Piece, ...]

    def describe(self) -> str:
        return f"a DTensor of shape {list(self.shape)} dtype {dtype_name(self.dtype)} placed {self.placements}"


class ReshardPlanning:
    """What :class:`~gpusnap.state.apply.Planner` does with DTensors (a mixin: it uses the
    planner's ``spec``, ``mismatch``, ``add_copy`` and ``add_box_copy``)."""

    resharded: list[str]
    sharded: bool

    def dnode(self, node: dict[str, Any], path: str) -> DTensorNode:
        where = path or "<root>"
        try:
            local = node.get("local")
            own_node = node["own"] if "own" in node else local
            if "pieces" in node:
                raw = [(p["offset"], p["shape"], p["local"]) for p in node["pieces"]]
            else:  # a rank manifest read as it is
                raw = [(node["offset"], node["local_shape"], local)] if local is not None else []
            placements = [str(p) for p in node["placements"]]
            parsed = DTensorNode(
                shape=tuple(int(d) for d in node["shape"]),
                dtype=dtype_from_name(node["dtype"], path),
                placements=placements,
                mesh=tuple(int(d) for d in node["mesh"]),
                own=None if own_node is None else self.spec(own_node, path),  # type: ignore[attr-defined]
                pieces=tuple(Piece((tuple(map(int, o)), tuple(map(int, s))), self.spec(n, path))  # type: ignore[attr-defined]
                             for o, s, n in (raw if reshardable(placements) else [])),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: malformed 'dtensor' node: {exc!r}") from exc
        for piece in parsed.pieces:
            if piece.spec.shape != piece.box[1]:
                raise CheckpointError(f"{where}: a piece of shape {list(piece.spec.shape)} claims a box of {list(piece.box[1])}")
        return parsed

    def dtensor_target(self, live: Any, node: dict[str, Any], path: str, *, allocate: bool) -> Slot:
        d = self.dnode(node, path)
        if is_dtensor(live):
            self.sharded = True
            if tuple(live.shape) != d.shape or live.dtype != d.dtype:
                return self.mismatch(path, f"the checkpoint has {d.describe()}, the target has shape "  # type: ignore[attr-defined,no-any-return]
                                     f"{list(live.shape)} dtype {dtype_name(live.dtype)}")
            local = live._local_tensor
            if (d.own is not None and encode_placements(live.placements) == d.placements
                    and tuple(live.device_mesh.shape) == d.mesh and tuple(local.shape) == d.own.shape):
                self.add_copy(local, d.own, path)  # type: ignore[attr-defined]
                return Value(live)
            target_placements = encode_placements(live.placements)
            if not reshardable(d.placements) or not reshardable(target_placements):
                return self.unreshardable(path, d, f"placed {target_placements} on a mesh of shape "
                                                   f"{list(live.device_mesh.shape)}")
            self.fill_box(local, box_of(live), d, path)
            return Value(live)
        if isinstance(live, torch.Tensor) or allocate:
            if not isinstance(live, torch.Tensor):  # state not made yet: the whole tensor, as DCP loads it
                device = device_here(d.pieces[0].spec.device) if d.pieces else torch.device("cpu")
                live = torch.empty(d.shape, dtype=d.dtype, device=device)
            elif tuple(live.shape) != d.shape or live.dtype != d.dtype:
                return self.mismatch(path, f"the checkpoint has {d.describe()}, the target has shape "  # type: ignore[attr-defined,no-any-return]
                                     f"{list(live.shape)} dtype {dtype_name(live.dtype)}")
            if not reshardable(d.placements):
                return self.unreshardable(path, d, "a whole tensor")
            self.fill_box(live, ((0,) * len(d.shape), d.shape), d, path)
            return Value(live)
        from .plain import type_name

        return self.mismatch(path, f"the checkpoint has {d.describe()}, app_state has a {type_name(live)}")  # type: ignore[attr-defined,no-any-return]

    def tensor_into_dtensor(self, live: Any, spec: TensorSpec, path: str) -> Slot:
        """A plain ``tensor`` node (the whole tensor) into DTensor ``live``: its box of it."""
        self.sharded = True
        if tuple(live.shape) != spec.shape or live.dtype != spec.dtype:
            return self.mismatch(path, f"the checkpoint has {spec.describe()}, the target is a DTensor of shape "  # type: ignore[attr-defined,no-any-return]
                                 f"{list(live.shape)} dtype {dtype_name(live.dtype)}")
        placements = encode_placements(live.placements)
        if not reshardable(placements):
            return self.mismatch(path, f"the target DTensor is placed {placements}: only Shard and Replicate "  # type: ignore[attr-defined,no-any-return]
                                 "layouts can take a tensor saved whole")
        whole = DTensorNode(spec.shape, spec.dtype, ["R"], (1,), None, (Piece(((0,) * len(spec.shape), spec.shape), spec),))
        self.fill_box(live._local_tensor, box_of(live), whole, path)
        return Value(live)

    def fill_box(self, target: torch.Tensor, box: Box, d: DTensorNode, path: str) -> None:
        """Fill ``target`` (holding ``box`` of the global tensor) from the pieces that meet it."""
        exact = next((p for p in d.pieces if p.box == box), None)
        if exact is not None:
            self.add_copy(target, exact.spec, path)  # type: ignore[attr-defined]
            return
        covered = 0
        for piece in d.pieces:
            common = intersect(piece.box, box)
            if common is None:
                continue
            covered += volume(common[1])
            self.add_box_copy(target, piece.spec, slices(common, piece.box), slices(common, box), path)  # type: ignore[attr-defined]
        if covered != volume(box[1]):
            self.mismatch(path, f"the checkpoint's pieces of {d.describe()} cover {covered} of the {volume(box[1])} "  # type: ignore[attr-defined]
                          f"elements this rank holds (box at {list(box[0])} of shape {list(box[1])})")
            return
        self.resharded.append(path)

    def unreshardable(self, path: str, d: DTensorNode, into: str) -> Slot:
        return self.mismatch(  # type: ignore[attr-defined,no-any-return]
            path, f"cannot reshard {d.describe()} on a mesh of shape {list(d.mesh)} into {into}: Partial and "
            "_StridedShard placements restore only into the layout and world size they were saved with"
        )
