"""A queued save's last steps, on the writer thread (or a blocking caller's): its chunks
stored, the manifest committed, then what follows a commit: retention, the promotion due,
a collective save's global decision. A save that fails validation is handed to its retry.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpusnap.capture import write_host_spans
from gpusnap.capture.history import CaptureHistory
from gpusnap.config import Config
from gpusnap.device import outside_graph_captures
from gpusnap.errors import ValidationError
from gpusnap.handles import CheckpointInfo
from gpusnap.save.job import SaveJob, release_state
from gpusnap.save.retries import Retries
from gpusnap.save.stats import incremental_note, window_stats
from gpusnap.save.tiers import Tiers, info_from_manifest, tier_name
from gpusnap.storage.fast_tier import FastTier
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.repository import Repository

__all__ = ["Committer"]

log = logging.getLogger("gpusnap")


class Committer:
    def __init__(self, config: Config, history: CaptureHistory, tiers: Tiers, retries: Retries,
                 io_pool: ThreadPoolExecutor, on_writer_thread: Callable[[], bool],
                 owner: Callable[[], object]) -> None:
        """``owner()``: what a queued promotion keeps alive (the exit hooks' owner, or None)."""
        self._config = config
        self._history = history
        self._tiers = tiers
        self._retries = retries
        self._pool = io_pool
        self._on_writer_thread = on_writer_thread
        self._owner = owner

    def run(self, repo: Repository, job: SaveJob) -> None:
        """Store and commit ``job`` into ``repo``; its handle reports the outcome. Only an
        interrupt on a blocking caller's own thread propagates (save() raises it)."""
        completion = job.completion
        capture = job.concurrent
        if capture is not None and capture.copier.streams:
            outside_graph_captures()  # finish() waits on events; the program may be capturing
        try:
            with capture.txn if capture is not None else repo.begin_write() as txn:
                if capture is not None:
                    entries = capture.finish()
                    completion.set_staged()
                    job.counters.bytes_total = sum(e.nbytes for e in entries)
                    job.counters.bytes_copied = capture.copier.bytes_copied
                    job.counters.add(written=capture.bytes_written, skipped=capture.bytes_skipped)
                else:
                    entries = write_host_spans(
                        job.flat,
                        job.host_spans,
                        txn,
                        chunk_size=self._config.chunk_size,
                        pool=self._pool,
                        counters=job.counters,
                        hashes=job.hashes,
                        piece_bytes=self._config.copy_piece_bytes,  # host copies exist: no staging limit
                    )
                job.host_spans.clear()  # release host copies before the commit's fsyncs
                manifest = Manifest(
                    id=completion.id,
                    tag=completion.tag if self._tiers.collective is None else None,  # (the global manifest's)
                    created=job.created,
                    chunk_size=self._config.chunk_size,
                    storages=entries,
                    tree=job.flat.tree,
                    stats=self._stats(job),
                )
                txn.commit(manifest)
        except BaseException as exc:  # the save failed: report it on the handle, commit nothing
            if capture is not None:
                capture.close_out(exc)  # its copier and store tasks stopped, its txn aborted
                self._history.learn_unseen_writes(capture.mismatched)
                if isinstance(exc, ValidationError) and self._retries.offer(job, exc):
                    return
            log.warning("gpusnap: checkpoint %s failed: %s", completion.id, exc)
            release_state(job)
            interrupted = not isinstance(exc, Exception) and not self._on_writer_thread()
            if interrupted:  # Ctrl-C in a blocking save, on the caller's thread: save() raises it
                completion.observe()
            completion.fail(exc)
            if interrupted:
                raise
            return
        if self._tiers.collective is not None:
            self._settle(repo, job, manifest)
        else:
            self._after_commit(repo, job, manifest)

    def _stats(self, job: SaveJob) -> dict[str, Any]:
        capture = job.concurrent
        duration = time.perf_counter() - job.started
        stats: dict[str, Any] = {
            "stall_s": duration if job.blocking else job.stall_s,
            "duration_s": duration,
            "bytes_total": job.counters.bytes_total,
            "bytes_copied": job.counters.bytes_copied,
            "bytes_written": job.counters.bytes_written,
            "bytes_cow": 0,
            "bytes_skipped": job.counters.bytes_skipped,
            "validation": "not needed: stop-the-world capture",
            "save_phases_s": dict(job.phases),
            "flatten_planned": job.flat.planned,  # the previous save's plan was reused
            "memory_tier": self._tiers.memory_note(),
        }
        if capture is None:
            return stats
        stats.update(window_stats(capture))
        share = None
        if capture.previous:  # the share the next save goes by (CaptureHistory.should_compare)
            total = job.counters.bytes_total
            share = capture.bytes_unchanged / total if total else 0.0
            self._history.learn_unchanged(share)
        stats["incremental"] = incremental_note(self._config.incremental, share, capture.compared)
        stats["validation"] = capture.validation
        if job.retry_note is not None:
            stats["validation"] += f" (a retry: the first attempt failed: {job.retry_note})"
            # its state is the program's at the retry, a later point than save()
            stats["consistent_point"] = "retry"
            stats["save_called"] = job.asked_at
        stats["access_order"] = self._history.learn_window(capture)
        trace = capture.window.trace
        if trace is not None:
            path = os.path.join(self._config.trace_dir, f"{job.completion.id}.trace.json")
            stats["trace_path"] = trace.write(path)
        return stats

    def _after_commit(self, repo: Repository, job: SaveJob, manifest: Manifest) -> None:
        """Committed: what follows never fails the save (an interrupt still propagates, after)."""
        completion = job.completion
        info = info_from_manifest(manifest, tier_name(repo))
        if job.retry_note is not None:
            log.warning("gpusnap: checkpoint %s%s holds the state at its retry (created %.3f), not at its save() "
                        "call (%.3f): the first attempt failed validation", completion.id,
                        f" (tag {completion.tag!r})" if completion.tag else "", job.created, job.asked_at or 0.0)
        try:
            info.stats["duration_s"] = time.perf_counter() - job.started
            if job.blocking:  # the caller waited through the commit too
                info.stats["stall_s"] = info.stats["duration_s"]
            self._history.learn_commit(manifest)
            if isinstance(repo, FastTier):
                if self._tiers.after_fast_commit(repo, manifest, promote=job.promote, keep=self._owner()):
                    info.stats["promotion"] = "queued"
            elif self._tiers.keep_last is not None:  # before wait() returns: list() shows keep_last
                self._tiers.retain(repo, self._tiers.keep_last)
        except Exception as exc:  # the save is committed: say what did not follow it
            log.warning("gpusnap: checkpoint %s committed, but what follows a commit failed: %r", completion.id, exc)
        finally:
            release_state(job)  # before wait() returns: nothing of the state is held after it
            completion.finish(info)

    def _settle(self, repo: Repository, job: SaveJob, manifest: Manifest) -> None:
        """A collective save's part is committed in this rank's root: the global decision,
        then retention (rank 0: of global manifests; every rank: of its own parts)."""
        collective = self._tiers.collective
        assert collective is not None
        completion = job.completion
        try:
            settled = collective.settle(manifest, completion.tag, manifest.stats)
        except BaseException as exc:
            log.warning("gpusnap: checkpoint %s failed: %s", completion.id, exc)
            release_state(job)
            completion.fail(exc)
            collective.retire(repo, manifest.id)
            if not isinstance(exc, Exception):
                raise
            return
        stats = dict(manifest.stats, duration_s=time.perf_counter() - job.started, coordination_s=settled.coordination_s,
                     coordination_phases_s=dict(settled.phases))
        if job.blocking:
            stats["stall_s"] = stats["duration_s"]
        info = CheckpointInfo(id=completion.id, tag=completion.tag, created=settled.created, nbytes=settled.nbytes,
                              stats=stats, world_size=settled.world_size)
        try:
            self._history.learn_commit(manifest)
            if collective.rank == 0:
                self._tiers.retain(collective.root_repository(create=True), self._tiers.keep_last)
            collective.retire(repo, manifest.id)
        except Exception as exc:  # the save is committed: say what did not follow it
            log.warning("gpusnap: checkpoint %s committed, but what follows a commit failed: %r", completion.id, exc)
        finally:
            release_state(job)
            completion.finish(info)


