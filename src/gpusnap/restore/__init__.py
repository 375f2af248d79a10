"""Restore: reading chunks back, verifying them and filling the target tensors."""

from gpusnap.restore.eager import RestoreCounters, load_spans

__all__ = ["RestoreCounters", "load_spans"]
