"""What ranks tell each other about one save: small JSON documents in the store.

Per save ``n`` (keys under the group's prefix)::

    <n>/part/<rank>   each rank, once: its part is durable (Part.ok) or failed (Part.error)
    <n>/parts         a counter each rank adds 1 to after its part: rank 0 polls one number
    <n>/decision      rank 0, once: committed, or why not (Decision)

So a save costs each rank two messages and rank 0 one more, whatever the state holds.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Decision", "Part", "decision_key", "part_key", "parts_key"]


def part_key(seq: int, rank: int) -> str:
    return f"{seq}/part/{rank}"


def parts_key(seq: int) -> str:
    return f"{seq}/parts"


def decision_key(seq: int) -> str:
    return f"{seq}/decision"


@dataclass(frozen=True)
class Part:
    """One rank's part of save ``id``: durable (``error`` None: its rank manifest's checksum
    and bytes), or failed. ``tag`` and ``signature`` (keys, kinds, shapes of its state) are
    what rank 0 checks the ranks agree on."""

    rank: int
    id: str
    error: str | None = None
    tag: str | None = None
    signature: str = ""
    checksum: str = ""
    nbytes: int = 0
    stats: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> Part:
        return cls(**json.loads(data.decode()))


@dataclass(frozen=True)
class Decision:
    """Rank 0's verdict on save ``id``: committed (``error`` None), or not and why.
    ``broken``: the ranks may no longer save at the same steps (a rank missed a save), so
    every later save of this Checkpointer is refused."""

    id: str
    error: str | None = None
    broken: bool = False
    created: float = 0.0
    nbytes: int = 0

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> Decision:
        return cls(**json.loads(data.decode()))
