"""The commit protocol's waits on one in-process store (threads as ranks, no process group):
what rank 0 gathers, a failed part ending the wait at once, a missing or dead rank."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch.distributed as dist

from gpusnap.distributed.exchange import Exchange
from gpusnap.distributed.messages import Decision, Part
from gpusnap.distributed.protocol import Missing, Rounds
from gpusnap.errors import CheckpointError


class _Liveness:
    def __init__(self, dead: tuple[int, ...] = ()) -> None:
        self.dead = dead

    def gone(self, ranks: list[int]) -> list[int]:
        return [r for r in ranks if r in self.dead]


def _rounds(store: Any, rank: int, size: int, timeout_s: float = 60.0, dead: tuple[int, ...] = ()) -> Rounds:
    return Rounds(store, store, rank, size, _Liveness(dead), timeout_s)  # type: ignore[arg-type]


def test_rank0_gathers_every_part_and_the_others_get_its_decision() -> None:
    store = dist.HashStore()
    ranks = [_rounds(store, r, 3) for r in range(3)]
    for r in (2, 1):
        assert ranks[r].report(1, Part(r, "x-1", tag="t", signature="s"))
        assert not ranks[r].report(1, Part(r, "x-1"))  # once
    ranks[0].report(1, Part(0, "x-1", tag="t", signature="s"))
    assert [p.rank for p in ranks[0].gather(1)] == [0, 1, 2]
    got: list[Decision] = []
    waiter = threading.Thread(target=lambda: got.append(ranks[1].await_decision(1)))
    waiter.start()
    ranks[0].publish(1, Decision("x-1", created=5.0, nbytes=7))
    waiter.join(60)
    assert got == [Decision("x-1", created=5.0, nbytes=7)]


def test_a_failed_part_ends_the_gather_at_once() -> None:
    store = dist.HashStore()
    rank0, rank2 = _rounds(store, 0, 3), _rounds(store, 2, 3)
    rank0.report(4, Part(0, "x-4"))
    rank2.report(4, Part(2, "x-4", error="rank 2's part failed: disk full"))
    parts = rank0.gather(4)  # rank 1 never reports: not waited for
    assert [(p.rank, p.error) for p in parts] == [(0, None), (2, "rank 2's part failed: disk full")]


def test_a_dead_rank_and_a_silent_one_are_named() -> None:
    store = dist.HashStore()
    rank0 = _rounds(store, 0, 2, dead=(1,))
    rank0.report(1, Part(0, "x-1"))
    with pytest.raises(Missing, match=r"rank\(s\) 1 ended"):
        rank0.gather(1)
    silent = _rounds(dist.HashStore(), 0, 2, timeout_s=0.01)
    silent.report(1, Part(0, "x-1"))
    with pytest.raises(Missing, match=r"rank\(s\) 1 did not report its part within Config.collective_timeout_s"):
        silent.gather(1)


def test_exchange_every_and_from_root() -> None:
    store = dist.HashStore()
    got: dict[int, Any] = {}

    def rank(r: int) -> None:
        ex = Exchange(store, r, 2, 60.0)
        got[r] = (ex.from_root("restore1/choice", ["ok", "id"] if r == 0 else None), ex.every("restore1/plan", r * 10))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == {0: (["ok", "id"], [0, 10]), 1: (["ok", "id"], [0, 10])}
    with pytest.raises(CheckpointError, match=r"rank\(s\) 1 did not reach restore2"):
        Exchange(store, 0, 2, 0.01).every("restore2/plan", None)
