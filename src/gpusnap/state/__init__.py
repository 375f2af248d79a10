"""The ``state`` layer: what to save (flatten ``app_state``) and where restored bytes go.

Save: :func:`flatten` -> :class:`FlatState` (manifest tree + :class:`StorageSpan` list).
Restore: :func:`plan_restore` -> :class:`RestorePlan`: frozen targets per span
(:class:`SpanTarget`, :class:`ByteTarget`), the books of what was applied, ``finish``.
Nothing here moves bytes; ``capture`` and ``restore`` (``restore/apply_bytes.py``) do.
"""

from __future__ import annotations

from .apply import ByteTarget, RestorePlan, SpanInfo, SpanTarget, TensorSpec, plan_restore
from .flatten import FlatState, Stateful, StorageSpan, flatten, is_stateful
from .plain import decode_plain, encode_plain, is_plain
from .rng import RNGState

__all__ = [
    "ByteTarget",
    "FlatState",
    "RNGState",
    "RestorePlan",
    "SpanInfo",
    "SpanTarget",
    "Stateful",
    "StorageSpan",
    "TensorSpec",
    "decode_plain",
    "encode_plain",
    "flatten",
    "is_plain",
    "is_stateful",
    "plan_restore",
]
