"""Capture: taking the bytes of every storage span at the consistent point."""

from gpusnap.capture.stop_the_world import (
    CaptureCounters,
    snapshot_to_host,
    write_host_spans,
)

__all__ = ["CaptureCounters", "snapshot_to_host", "write_host_spans"]
