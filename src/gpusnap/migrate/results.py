"""What a live migration reports: per round on each side, the handoff, the receive."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AppliedRound", "HandoffInfo", "ReceiveInfo", "RoundInfo"]


@dataclass(frozen=True)
class RoundInfo:
    """A round the source committed: its checkpoint ``id`` and place ``seq`` (from 1),
    ``final`` for the handoff; ``bytes_total`` of state, ``bytes_moved`` written into the
    transport (the rest was unchanged since the round before, or deduplicated);
    ``stall_s`` the program waited in ``precopy()``/``save()``, ``duration_s`` to committed.
    ``fast``: a fast handoff, the changed chunks as a delta on the round before (whose ``id``
    it carries: it is no checkpoint of its own)."""

    id: str
    seq: int
    final: bool
    bytes_total: int
    bytes_moved: int
    stall_s: float
    duration_s: float
    fast: bool = False


@dataclass(frozen=True)
class HandoffInfo:
    """``Source.handoff()``'s result: the final round, how long the program waited in
    ``handoff()`` (its share of the downtime), and every round committed before it;
    ``general_why``: why the handoff was not a fast one (None when it was)."""

    round: RoundInfo
    handoff_s: float
    rounds: tuple[RoundInfo, ...]
    general_why: str | None = None


@dataclass(frozen=True)
class AppliedRound:
    """A round the target put in place: ``bytes_moved`` of its ``bytes_total`` were read
    and written (the chunks that differ from the round applied before: ``full`` when
    there was none), in ``apply_s`` seconds (a lazy handoff: until ``receive`` returned);
    ``fast``: a fast handoff's delta on round ``id``."""

    id: str
    seq: int
    final: bool
    bytes_total: int
    bytes_moved: int
    chunks_moved: int
    full: bool
    apply_s: float
    fast: bool = False


@dataclass(frozen=True)
class ReceiveInfo:
    """``Target.receive()``'s result: the handoff round's ``checkpoint`` id, every round
    applied (oldest first, the handoff last), ``handoff_s`` from finding the handoff round
    to its bytes in place (lazy: to ``receive`` returning), ``waited_s`` for rounds overall."""

    checkpoint: str
    rounds: tuple[AppliedRound, ...]
    handoff_s: float
    waited_s: float
    lazy: bool
