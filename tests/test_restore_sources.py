"""The loader's three sources (restore/pipeline/sources/): every region handed out comes back
to its pool exactly once, on every path (success, a corrupt chunk, cancellation, a worker's death, an
error of the source itself), and no wait blocks for good.

Each source gets each failure through a fake worker (reader processes, direct-copy helpers)
that reads the real packs with the worker's own code (``reader_worker.read_runs``) and fails
on cue; the loader runs its real reader threads and copy thread on CPU targets. ``HANG_S``
only turns a hang into a failure: no test waits for time to pass.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from faults import HANG_S
from restore_support import add_device_hashes, corrupt_chunk, tiny_config

import gpusnap
from gpusnap import CheckpointError, IntegrityError
from gpusnap.restore.pipeline.loader import Loader
from gpusnap.restore.pipeline.schedule import LoadSpan, Piece
from gpusnap.restore.pipeline.sources.direct_reads import DirectReads
from gpusnap.restore.pipeline.sources.host_reads import HostReads
from gpusnap.restore.pipeline.sources.proc_reads import ProcReads
from gpusnap.restore.pipeline.sources.reader_procs import ReaderDied, ReaderProcs
from gpusnap.restore.pipeline.sources.reader_worker import read_runs
from gpusnap.restore.pipeline.sources.source import Region
from gpusnap.restore.pipeline.staging import SlotPool, can_share
from gpusnap.restore.pipeline.stats import LoadStats
from gpusnap.state import SpanInfo, plan_restore
from gpusnap.storage.repository import Repository

pytestmark = pytest.mark.skipif(not can_share(), reason="shared regions need memfd (Linux)")

CS = 512  # tiny_config's chunk size
SLOT = 2 * CS  # a region holds a piece of two chunks
N = 5  # tensors of 6 chunks each: 3 pieces apiece


# -- fakes ---------------------------------------------------------------------------------------
class _Cue:
    """When a fake worker fails: ``mode`` on request number ``at`` (0 first) and, with
    ``every``, on every one after it."""

    def __init__(self, mode: str = "ok", at: int = 0, *, every: bool = False) -> None:
        self.mode, self.at, self.every = mode, at, every
        self.requests = 0
        self.lock = threading.Lock()
        self.loader: Loader | None = None  # for "cancel"

    def next(self) -> str:
        with self.lock:
            n, self.requests = self.requests, self.requests + 1
        return self.mode if n == self.at or (self.every and n > self.at) else "ok"

    def act(self, mode: str, view: memoryview, runs: list[tuple[str, int, int, int]]) -> list[int]:
        if mode == "died":
            raise ReaderDied("reader process 4242 is gone (exit code -9)")
        if mode == "oserror":
            raise OSError(5, "Input/output error", runs[0][0])
        if mode == "broken":
            raise RuntimeError("the worker's source broke")
        if mode == "cancel":
            assert self.loader is not None
            self.loader.schedule.fail(CheckpointError("restore cancelled"))
        got = read_runs(runs, view)
        if mode == "short":
            got[-1] -= 1
        return got


class _FakeProcs:
    """``ReaderProcs``' interface over ``pool``'s shared memory, failing on ``cue``."""

    def __init__(self, n: int, pool: SlotPool, cue: _Cue) -> None:
        assert pool.shared is not None
        self.n, self.pool, self.cue = n, pool, cue
        self.view = memoryview(pool.shared.tensor.numpy())

    def __len__(self) -> int:
        return self.n

    def read(self, k: int, runs: list[tuple[str, int, int, int]]) -> list[int]:
        return self.cue.act(self.cue.next(), self.view, runs)


class _FakeDirect:
    """``DirectCopies``' interface with CPU landing slots, failing on ``cue``; ``"unready"``
    makes ``ready`` raise (a helper that died while it started)."""

    def __init__(self, n: int, cue: _Cue, depth: int = 2) -> None:
        self.device = torch.device("cpu")
        self.n, self.cue = n, cue
        self._buffer = torch.zeros(n * depth * SLOT, dtype=torch.uint8)
        self.landing = SlotPool(n * depth, SLOT, pinned=False, backing=self._buffer)
        self.view = memoryview(self._buffer.numpy())

    def __len__(self) -> int:
        return self.n

    def ready(self, k: int) -> bool:
        if self.cue.mode == "unready":
            raise ReaderDied("direct-copy process 4242 did not start: ('failed', 'no device')")
        return True

    def copy(self, k: int, runs: list[tuple[str, int, int, int]]) -> tuple[list[int], Any]:
        return self.cue.act(self.cue.next(), self.view, runs), None


# -- set-up --------------------------------------------------------------------------------------
def _source() -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.randn(128 * 6, generator=torch.Generator().manual_seed(i)) for i in range(N)}


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, str, dict[str, torch.Tensor]]:
    root = tmp_path / "ck"
    source = _source()
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        checkpoint = ck.save(source, blocking=True).wait().id
    add_device_hashes(root, checkpoint)
    return root, checkpoint, source


class _Run:
    """A loader over ``saved`` with the source ``kind`` and a fake worker failing on ``cue``."""

    def __init__(self, saved: tuple[Path, str, dict[str, torch.Tensor]], kind: str, cue: _Cue, *,
                 regions: int = 2, threads: int = 3) -> None:
        kind, _, check = kind.partition("+")  # "+check": checked on the device, by the copy thread
        root, checkpoint, self.source = saved
        repo = Repository.open(root)
        manifest = repo.load_manifest(checkpoint)
        self.target = {k: torch.zeros_like(v) for k, v in self.source.items()}
        plan = plan_restore(self.target, manifest.tree, [SpanInfo(e.nbytes, e.device) for e in manifest.storages])
        self.slots = SlotPool(regions, SLOT, pinned=False, shared=kind == "procs")
        self.procs = _FakeProcs(threads, self.slots, cue) if kind == "procs" else None
        self.direct = _FakeDirect(threads, cue) if kind == "direct" else None
        self.loader = Loader(repo, manifest, plan, order=range(len(manifest.storages)), threads=threads,
                             slots=self.slots, streams={}, verify=True,
                             verify_on_device=True if kind == "direct" or check else None,
                             procs=self.procs, direct=self.direct)  # type: ignore[arg-type]
        cue.loader = self.loader

    def run(self) -> BaseException | None:
        self.loader.start()
        assert self.loader.join(HANG_S), "the load hung"
        return self.loader.error

    def all_back(self) -> bool:
        ok = self.slots.available() == self.slots.slots
        if self.direct is not None:
            ok = ok and self.direct.landing.available() == self.direct.landing.slots
        return ok

    def restored(self) -> bool:
        return all(torch.equal(self.target[k], v) for k, v in self.source.items())


# "+check": the batches go through the copy thread (checked on the device); without it CPU
# targets are written by the reader threads themselves. Direct copies are always checked.
KINDS = ["threads", "threads+check", "procs", "procs+check", "direct"]
WORKERS = ["procs", "procs+check", "direct"]


# -- every source, every outcome -----------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_every_byte_arrives_and_every_region_comes_back(saved: Any, kind: str) -> None:
    run = _Run(saved, kind, _Cue())
    assert run.run() is None
    assert run.restored() and run.all_back()
    stats = run.loader.stats
    if kind.startswith("procs"):
        assert stats.proc_batches > 0 and stats.proc_fallbacks == 0
    if kind == "direct":
        assert stats.direct_batches > 0 and stats.direct_fallbacks == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_corrupt_chunk_fails_the_load_and_every_region_comes_back(saved: Any, kind: str) -> None:
    root, _, source = saved
    corrupt_chunk(root, source["t2"].numpy().tobytes()[:64], 9)
    run = _Run(saved, kind, _Cue())
    error = run.run()
    assert isinstance(error, IntegrityError) and "t2" in str(error)
    assert run.all_back()


@pytest.mark.parametrize("kind", KINDS)
def test_a_cancelled_load_gives_every_region_back(saved: Any, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The program gives up (``Schedule.fail``, as a lazy restore's failure does) while a
    batch is being read: the load stops with that error and every region comes back."""
    cue = _Cue("cancel", at=1)
    if kind.startswith("threads"):  # (no worker: the cancel comes during a thread's read)
        real = HostReads.read_into

        def read_into(self: HostReads, *args: Any, **kwargs: Any) -> None:
            if cue.next() == "cancel":
                assert cue.loader is not None
                cue.loader.schedule.fail(CheckpointError("restore cancelled"))
            real(self, *args, **kwargs)

        monkeypatch.setattr(HostReads, "read_into", read_into)
    run = _Run(saved, kind, cue)
    error = run.run()
    assert isinstance(error, CheckpointError) and "restore cancelled" in str(error)
    assert run.all_back()


@pytest.mark.parametrize("kind", WORKERS)
@pytest.mark.parametrize("mode", ["died", "oserror", "short"])
def test_a_failed_request_falls_back_to_the_host_path(saved: Any, kind: str, mode: str) -> None:
    """One request fails: its batch is read by the thread; the load completes."""
    run = _Run(saved, kind, _Cue(mode, at=1))
    assert run.run() is None
    assert run.restored() and run.all_back()
    fallbacks = run.loader.stats.direct_fallbacks if kind == "direct" else run.loader.stats.proc_fallbacks
    assert fallbacks == 1


@pytest.mark.parametrize("kind", WORKERS)
def test_every_worker_dead_still_restores_through_the_threads(saved: Any, kind: str) -> None:
    run = _Run(saved, kind, _Cue("died", at=0, every=True))
    assert run.run() is None
    assert run.restored() and run.all_back()
    source = run.loader.source
    assert isinstance(source, (ProcReads, DirectReads)) and source.gone  # (not asked again)


def test_a_helper_that_died_while_it_started_leaves_its_batches_to_the_host(saved: Any) -> None:
    run = _Run(saved, "direct", _Cue("unready"))
    assert run.run() is None
    assert run.restored() and run.all_back()
    assert run.loader.stats.direct_batches == 0 and run.loader.stats.direct_fallbacks > 0


@pytest.mark.parametrize("kind", WORKERS)
def test_an_error_in_the_source_itself_fails_the_load_and_gives_every_region_back(saved: Any, kind: str) -> None:
    run = _Run(saved, kind, _Cue("broken", at=2))
    error = run.run()
    assert isinstance(error, CheckpointError) and "the worker's source broke" in str(error)
    assert run.all_back()


@pytest.mark.parametrize("kind", KINDS)
def test_one_region_and_many_readers_never_hang_on_a_failure(saved: Any, kind: str) -> None:
    """Three readers share one region (and, for direct copies, two landing slots): a reader
    waits for a region whenever the load fails, and must be woken."""
    root, _, source = saved
    corrupt_chunk(root, source["t3"].numpy().tobytes()[:64], 9)
    for _ in range(5):
        run = _Run(saved, kind, _Cue(), regions=1)
        assert isinstance(run.run(), IntegrityError)
        assert run.all_back()


# -- the region ----------------------------------------------------------------------------------
def test_a_region_goes_back_once_however_often_it_is_released() -> None:
    pool = SlotPool(2, 64, pinned=False)
    region = Region([], pool.acquire(), pool)
    region.release()
    region.release()
    assert pool.available() == 2 and region.released
    again = Region([], pool.acquire(), pool)  # the same memory, another owner
    region.release()  # a late cleanup of the old owner must not free it
    assert pool.available() == 1 and not again.released
    again.release()
    assert pool.available() == 2


def test_a_region_is_released_once_by_racing_owners() -> None:
    pool = SlotPool(1, 64, pinned=False)
    for _ in range(50):
        region = Region([], pool.acquire(), pool)
        start = threading.Barrier(4)

        def release() -> None:
            start.wait()
            region.release()

        threads = [threading.Thread(target=release) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG_S)
        assert pool.available() == 1


def test_settle_runs_what_the_source_left_once_per_call() -> None:
    pool = SlotPool(1, 64, pinned=False)
    seen: list[int] = []
    region = Region([(None, 0), (None, 32)], pool.acquire(), pool,  # type: ignore[list-item]
                    settle=lambda r, j: seen.append(j))
    region.settle_all()
    region.settle_with(None)
    region.settle_all()
    region.settle(1)
    assert seen == [0, 1]
    region.release()


# -- a real reader process that dies -------------------------------------------------------------
def test_a_killed_reader_process_is_a_fallback_not_a_hang(saved: Any) -> None:
    """SIGKILL of the real worker: its next request is ``ReaderDied`` (end of the pipe), the
    source fills the region from the host path and never asks that process again."""
    root, checkpoint, source = saved
    repo = Repository.open(root)
    manifest = repo.load_manifest(checkpoint)
    pool = SlotPool(1, SLOT, pinned=False, shared=True)
    stats = LoadStats()
    host = HostReads(repo, manifest, pool, stats, lambda i: f"tensor t{i}", verify=True)
    procs = ReaderProcs(1, pool)
    try:
        assert procs.read(0, []) == []  # (started and answering)
        procs._procs[0].send_signal(signal.SIGKILL)
        procs._procs[0].wait()
        reads = ProcReads(procs, host)
        e = manifest.storages[0]
        ls = LoadSpan(index=0, nbytes=e.nbytes, chunks=len(e.chunks), streamed=True, devices=frozenset())
        piece = Piece(ls, first=0, count=2, offset=0, nbytes=SLOT)
        region = reads.fill([(piece, 0)], 0, host_verify=True)
        assert reads.gone == {0} and stats.proc_fallbacks == 1 and pool.available() == 0
        region.settle_all()  # (the thread reads it)
        assert bytes(pool.bytes_of(region.data)) == source["t0"].numpy().tobytes()[:SLOT]
        region.release()
        assert pool.available() == 1
        region = reads.fill([(piece, 0)], 0, host_verify=True)  # not asked again
        assert stats.proc_fallbacks == 1
        region.release()
    finally:
        procs.close()
