"""A promotion's runs are written in order by a few pool tasks, not one future per run: the
futures of a whole promotion, alive for its seconds, filled the oldest generation of
Python's collector and brought on full collections of the program's heap."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fast_support import CFG, saved_for_promotion

from gpusnap.storage.promote import promote
from gpusnap.storage.repository import Repository
from gpusnap.storage.run_writers import RunWriters


class _CountingPool(ThreadPoolExecutor):
    """A pool that counts the tasks handed to it (each one future and its objects)."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.submitted = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


def test_a_promotion_hands_its_pool_one_task_per_worker_not_one_per_run(tmp_path: Path) -> None:
    durable, _fast, tier, manifest, runs = saved_for_promotion(tmp_path)
    pool = _CountingPool(3)
    repo = Repository.open(durable, create=True, config=CFG)
    try:
        promoted = promote(tier, manifest, repo, pool, workers=3)
    finally:
        pool.shutdown()
        repo.close()
    assert pool.submitted == 3
    assert Repository.open(durable).list()[0].id == promoted.id
    assert Repository.open(durable).verify().ok


def _runs(groups: list[int]) -> list[tuple[int, list[str]]]:
    """``groups[k]`` runs for group k, each named after its place."""
    return [(k, [f"g{k}r{i}a", f"g{k}r{i}b"]) for k, n in enumerate(groups) for i in range(n)]


def test_each_group_gets_its_runs_names_in_order_whatever_order_they_finish_in() -> None:
    runs = _runs([3, 1, 2])
    release = {tuple(r): threading.Event() for _k, r in runs}
    written: list[str] = []

    def store(run: list[str]) -> list[str]:
        release[tuple(run)].wait()
        written.append(run[0])
        return [n.upper() for n in run]

    writers = RunWriters(runs, store)
    with ThreadPoolExecutor(6) as pool:
        writers.start(pool, 6)
        try:
            for _k, run in reversed(runs):  # the last run finishes first
                release[tuple(run)].set()
            assert writers.group(0) == ["G0R0A", "G0R0B", "G0R1A", "G0R1B", "G0R2A", "G0R2B"]
            assert writers.group(1) == ["G1R0A", "G1R0B"]
            assert writers.group(2) == ["G2R0A", "G2R0B", "G2R1A", "G2R1B"]
        finally:
            writers.stop()
    assert sorted(written) == sorted(r[0] for _k, r in runs)
    assert writers.group(7) == []  # (a group with no runs: nothing to wait for)


def test_after_a_failure_no_run_starts_the_runs_in_flight_finish_and_stop_waits_for_them() -> None:
    runs = _runs([1, 4])
    started: list[str] = []
    in_flight = threading.Event()
    finish = threading.Event()
    lock = threading.Lock()

    def store(run: list[str]) -> list[str]:
        with lock:
            started.append(run[0])
        if run[0] == "g0r0a":  # (still being written when the failure comes)
            in_flight.set()
            finish.wait()
            return run
        if run[0] == "g1r0a":
            in_flight.wait()
            raise OSError(28, "no space left")
        return run

    writers = RunWriters(runs, store)
    got: list[list[str]] = []
    with ThreadPoolExecutor(2) as pool:
        writers.start(pool, 2)  # (two tasks: the second takes g1r0 and fails; none takes more)
        waiting = threading.Thread(target=lambda: got.append(writers.group(0)))
        waiting.start()
        with pytest.raises(OSError, match="no space"):
            writers.group(1)  # (its runs after the failed one never start)
        assert waiting.is_alive()  # group 0's run is still being written: it waits for it
        finish.set()
        waiting.join()
        assert got == [["g0r0a", "g0r0b"]]
        writers.stop()
    assert sorted(started) == ["g0r0a", "g1r0a"]  # nothing started after the failure


def test_failures_are_raised_in_the_order_of_the_groups_not_of_time() -> None:
    runs = _runs([1, 1])
    later_failed = threading.Event()

    def store(run: list[str]) -> list[str]:
        if run[0] == "g1r0a":
            try:
                raise OSError(5, "the later group's run")
            finally:
                later_failed.set()
        later_failed.wait()  # (the earlier group's run fails after it)
        raise ValueError("the earlier group's run")

    writers = RunWriters(runs, store)
    with ThreadPoolExecutor(2) as pool:
        writers.start(pool, 2)
        try:
            with pytest.raises(ValueError, match="earlier"):
                writers.group(0)
        finally:
            writers.stop()


def test_writers_whose_tasks_never_run_raise_instead_of_waiting() -> None:
    blocker, release = ThreadPoolExecutor(1), threading.Event()
    blocker.submit(release.wait)  # (its only thread is busy: the writers' task stays queued)
    writers = RunWriters(_runs([2]), lambda run: run)
    writers.start(blocker, 1)
    blocker.shutdown(wait=False, cancel_futures=True)  # (the queued task is cancelled)
    try:
        with pytest.raises(CancelledError):
            writers.group(0)
    finally:
        release.set()
        writers.stop()
    RunWriters([], lambda run: run).start(blocker, 8)  # (no runs: no task, even on a closed pool)
