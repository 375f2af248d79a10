"""Live migration: a running program hands its state to a new process, on this machine or
another, while it keeps running until a point it chooses (docs/moving.md, "Live migration").

>>> from gpusnap.migrate import Source, Target
>>> src = Source(app_state)             # in the running program            # doctest: +SKIP
>>> src.precopy()                       # a round of changed bytes, between steps  # doctest: +SKIP
>>> src.handoff()                       # at a step boundary: the last delta   # doctest: +SKIP
>>> Target(src.address).receive(app_state)   # in the new process            # doctest: +SKIP

Modules: ``source`` and ``target`` (the two sides), ``transport`` (the root the rounds go
through and the migration's own small files), ``bell`` (the target's doorbell),
``results`` (what each side reports), ``errors``. The deltas are ``restore.delta``'s.
"""

from gpusnap.migrate.errors import MigrationError
from gpusnap.migrate.results import AppliedRound, HandoffInfo, ReceiveInfo, RoundInfo
from gpusnap.migrate.source import CHUNK_SIZE, Source
from gpusnap.migrate.target import Target

__all__ = ["CHUNK_SIZE", "AppliedRound", "HandoffInfo", "MigrationError", "ReceiveInfo", "RoundInfo", "Source",
           "Target"]
