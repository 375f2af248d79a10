"""The ``state`` layer: what to save (flatten ``app_state``) and where restored bytes go.

Save: :func:`flatten` -> :class:`FlatState` (manifest tree + :class:`StorageSpan` list).
Restore: :func:`plan_restore` -> :class:`RestorePlan` (``apply_span`` per span, ``finish``).
Nothing here moves bytes between host and storage; ``capture`` and ``restore`` do.
"""

from __future__ import annotations

from .apply import RestorePlan, SpanInfo, plan_restore
from .flatten import FlatState, Stateful, StorageSpan, flatten, is_stateful
from .plain import decode_plain, encode_plain, is_plain
from .rng import RNGState

__all__ = [
    "FlatState",
    "RNGState",
    "RestorePlan",
    "SpanInfo",
    "Stateful",
    "StorageSpan",
    "decode_plain",
    "encode_plain",
    "flatten",
    "is_plain",
    "is_stateful",
    "plan_restore",
]
