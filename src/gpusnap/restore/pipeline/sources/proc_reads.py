"""Reader processes as a source: reader thread ``k`` has process ``k`` read its batches.

Per batch the thread plans the runs (``HostReads.plan_runs``) into a region of the shared
pool and sends them in one request (``ReaderProcs.read``); it sleeps in a pipe read meanwhile
(GIL released), then checks the pieces on the host in ``settle`` if asked. A request that
fails (the process died, a pack removed by a gc, a short read, any ``OSError``) leaves the
region to the host path: the thread reads the batch itself in ``settle``, which raises the
error the thread path raises. A dead process is not asked again in this load.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gpusnap.restore.pipeline.sources.host_reads import HostReads, Run
from gpusnap.restore.pipeline.sources.reader_procs import ReaderDied, ReaderProcs
from gpusnap.restore.pipeline.sources.source import Batch, Region
from gpusnap.restore.pipeline.stats import LoadStats

__all__ = ["ProcReads", "ask_worker"]


class ProcReads:
    """``procs`` reading into ``host``'s (shared) pool; the host path for what they cannot do."""

    def __init__(self, procs: ReaderProcs, host: HostReads) -> None:
        if host.pool.shared is None:
            raise ValueError("reader processes need a SlotPool made with shared=True")
        self.procs = procs
        self.host = host
        self.gone: set[int] = set()  # reader threads whose process is gone

    def fill(self, batch: Batch, k: int, *, host_verify: bool) -> Region:
        region = self.host.fill(batch, k, host_verify=host_verify)  # (settled by the thread, unless...)
        if k in self.gone:
            return region
        try:
            planned = self.host.plan_runs(batch, self.host.pool.offset_of(region.data))
            if planned is None:
                return region
            reads, requests = planned
            started = time.perf_counter()
            if ask_worker(lambda: (self.procs.read(k, requests), None), requests, k, self.gone, self.host.stats,
                          "proc_fallbacks") is None:
                return region
            self.host.stats.add(proc_batches=1, read_s=time.perf_counter() - started)
        except BaseException:
            region.release()
            raise
        region.settle_with(self._check, reads)  # ...the process read them: settle only checks
        return region

    def _check(self, region: Region, j: int) -> None:
        read = region.reads[id(region.pieces[j][0])]
        self.host.check_read(read, self.host.pool.bytes_of(region.data), host_verify=region.host_verify)


def ask_worker(request: Callable[[], tuple[list[int], Any]], runs: list[Run], k: int, gone: set[int],
               stats: LoadStats, fallbacks: str) -> tuple[list[int], Any] | None:
    """A worker process's answer to reader thread ``k``'s ``request`` for ``runs`` (bytes got
    per run, and what else it returns); None, counted under stats ``fallbacks``, when the
    host path must do the batch instead: the worker died (``k`` goes into ``gone``, for the
    rest of the load), a pack is gone (a gc) or unreadable, or a run came back short (the
    host path explains either, naming the chunk)."""
    try:
        answer = request()
    except ReaderDied:
        gone.add(k)
        stats.add(**{fallbacks: 1})
        return None
    except OSError:
        stats.add(**{fallbacks: 1})
        return None
    if any(g != r[2] for g, r in zip(answer[0], runs)):
        stats.add(**{fallbacks: 1})
        return None
    return answer
