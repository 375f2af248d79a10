"""Capture: the bytes of every storage span, as they were at the consistent point.

A concurrent save (``concurrent``) opens a capture window (``window``): a tracker dispatch
mode (``tracker``, ``schema``) and copy-on-write shadows keep uncopied bytes as they were,
a copier (``copier``, ``address_copy``) moves them off the device through staging
(``staging``) or the fast tier's slabs (``fast_arena``), and chunk hashes (``validation``)
catch writes nothing saw. ``stop_the_world`` copies everything at once instead. What saves
teach each other lives in ``history``; one save's frozen options in ``options``.
"""

from gpusnap.capture.stop_the_world import (
    CaptureCounters,
    snapshot_to_host,
    write_host_spans,
)

__all__ = ["CaptureCounters", "snapshot_to_host", "write_host_spans"]
