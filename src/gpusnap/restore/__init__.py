"""Restore: reading chunks back, verifying them and filling the target tensors in place.

``restorer`` (what ``Checkpointer.restore`` calls) picks ``eager`` (verify everything
first), ``pipeline/`` (the pipelined loader) or ``lazy/``, or asks a restore server
(``via_server/``); ``active`` registers every lazy restore of the process. ``cold`` (the pieces of
``gpusnap.cold_start``), ``template_free`` (``gpusnap.load``, with ``key_select``) and ``rank_view`` build on them.
"""

from gpusnap.restore.cold import empty_model
from gpusnap.restore.eager import RestoreCounters, load_spans
from gpusnap.restore.restorer import AUTO_UPFRONT_BYTES, Restorer, Verify

__all__ = ["AUTO_UPFRONT_BYTES", "RestoreCounters", "Restorer", "Verify", "empty_model", "load_spans"]
