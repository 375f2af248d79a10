"""A collective Checkpointer's protocol: one consistent checkpoint across the ranks of a
``torch.distributed`` job (docs/distributed.md).

- ``group``: who the ranks are, the store they talk through, the run id they agree on once;
- ``messages``, ``protocol``: a save's parts, rank 0's decision, the waits between them;
- ``liveness``: whether a rank waited for has died (its root's writer lease); ``poll``: how
  every wait on the store polls;
- ``exchange``: the small agreements of a collective restore;
- ``collective``: what the Checkpointer asks at save, commit, failure and restore;
- ``restore``: the collective restore.

No collective of the program's process group runs here: ranks coordinate through the
job's store (O(1) messages per rank per save) and the storage.
"""

from gpusnap.distributed.collective import Collective

__all__ = ["Collective"]
