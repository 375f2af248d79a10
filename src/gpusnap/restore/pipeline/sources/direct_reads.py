"""Direct copies as a source: helper ``k`` copies reader thread ``k``'s device-checked batches
from the page cache straight into a landing slot on the device (``sources.direct_copies``).

Only batches checked on the device for the helpers' device go this way (nothing else would
check them); the rest, and every batch the helper cannot do (still starting, broken, a pack
gone, a short run), go to the host path (``fallback``: reader processes or threads). A
broken helper is not asked again in this load. The region handed out is the landing slot,
``on_device``, with the helper's event ``after``: the copy thread makes its stream wait for
it, hashes the slot where it is, and releases it once the copies out of it have run.
"""

from __future__ import annotations

import time

from gpusnap.restore.pipeline.sources.direct_copies import DirectCopies
from gpusnap.restore.pipeline.sources.host_reads import HostReads
from gpusnap.restore.pipeline.sources.proc_reads import ask_worker
from gpusnap.restore.pipeline.sources.reader_procs import ReaderDied
from gpusnap.restore.pipeline.sources.source import Batch, Region, Source

__all__ = ["DirectReads"]


class DirectReads:
    """``direct``'s helpers for device-checked batches; ``fallback`` for everything else."""

    def __init__(self, direct: DirectCopies, host: HostReads, fallback: Source) -> None:
        self.direct = direct
        self.host = host
        self.fallback = fallback
        self.gone: set[int] = set()  # reader threads whose helper is gone

    def fill(self, batch: Batch, k: int, *, host_verify: bool) -> Region:
        region = self._copy(batch, k)
        return region if region is not None else self.fallback.fill(batch, k, host_verify=host_verify)

    def _copy(self, batch: Batch, k: int) -> Region | None:
        """The batch in a landing slot, copied by helper ``k``; None (nothing held) when the
        host path must stage it."""
        direct = self.direct
        ls = batch[0][0].span
        if not ls.device_check or k in self.gone or ls.devices != {direct.device}:
            return None
        try:
            if not direct.ready(k):
                return None  # still starting (a Checkpointer's first restores): stage on the host
        except ReaderDied:
            self.gone.add(k)
            self.host.stats.add(direct_fallbacks=1)
            return None
        started = time.perf_counter()
        landing = direct.landing.acquire()
        self.host.stats.add(region_wait_s=time.perf_counter() - started)
        region = Region(batch, landing, direct.landing, on_device=True)
        try:
            planned = self.host.plan_runs(batch, direct.landing.offset_of(landing))
            if planned is None:
                region.release()
                return None
            reads, requests = planned
            started = time.perf_counter()
            answer = ask_worker(lambda: direct.copy(k, requests), requests, k, self.gone, self.host.stats,
                                "direct_fallbacks")
            if answer is None:
                region.release()
                return None
            self.host.stats.add(direct_batches=1, direct_s=time.perf_counter() - started)
            for read in reads.values():
                self.host.count(read.piece, reads=len(read.runs), read_s=0.0, verify_s=0.0, host_verify=False)
        except BaseException:
            region.release()
            raise
        region.after = answer[1]
        return region
