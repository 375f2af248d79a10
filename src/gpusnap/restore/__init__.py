"""Restore: reading chunks back, verifying them and filling the target tensors in place.

- ``restorer``: what ``Checkpointer.restore`` calls; picks verify-first, pipelined or lazy.
- ``loader`` (+ ``schedule``, ``staging``): reader threads, chunk by chunk, into the targets.
- ``lazy`` (+ ``gate``, ``opaque``): the program runs while the loader works; ops wait only
  for the buffers they touch.
- ``eager``: the verify-everything-first path.
- ``cold``: cold start of a model built without initialisation.
"""

from gpusnap.restore.cold import cold_start, empty_model
from gpusnap.restore.eager import RestoreCounters, load_spans
from gpusnap.restore.restorer import AUTO_UPFRONT_BYTES, Restorer, Verify

__all__ = ["AUTO_UPFRONT_BYTES", "RestoreCounters", "Restorer", "Verify", "cold_start", "empty_model", "load_spans"]
