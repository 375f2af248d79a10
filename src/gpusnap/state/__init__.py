"""The ``state`` layer: what to save (flatten ``app_state``) and where restored bytes go.

Save: ``flatten`` (walking with ``walker``, ``flat``, ``plain``, ``dtensor``) -> :class:`FlatState`.
Restore: ``apply.plan_restore`` (``nodes``; ``reshard`` for DTensors) -> ``plan.RestorePlan``:
frozen ``targets`` per span, the ``slots`` rebuilt at ``finish``. ``tree`` reads manifest
trees; ``rng`` is :class:`RNGState`. Nothing here moves bytes; ``capture`` and
``restore.apply_bytes`` do.
"""

from __future__ import annotations

from .apply import plan_restore
from .flatten import FlatState, Stateful, StorageSpan, flatten, is_stateful
from .plain import decode_plain, encode_plain, is_plain
from .plan import RestorePlan
from .rng import RNGState
from .targets import ByteTarget, SpanInfo, SpanTarget, TensorSpec

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
