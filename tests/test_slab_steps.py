"""Slabs made in steps: ``MappedMemory(step=...)`` populates a mapping a step at a time and
page-locks it in one registration (a copy may not cross two), undone when the last view goes,
or at once when it is refused; and the fast tier's background preparer rests between its
steps while nobody waits for its slab (``storage/slab_prep.py``): a thread that waits for the
slab in hand, or ``close()``, ends the rests.

Deterministic: the rests are made endless (``REST_FACTOR``) so that only a hurry can end
them; every wait is on an Event bounded by ``HANG_S``, which only a hang reaches.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fast_support import HANG_S, cfg, in_thread

from gpusnap import host_map
from gpusnap.storage import slab_prep
from gpusnap.storage.fast_tier import FastTier
from gpusnap.storage.slab_prep import SlabPreparer

KiB, MiB = 1 << 10, 1 << 20
SLAB = 2 * MiB  # fast_support's fast_slab_bytes
STEP = 512 * KiB


class FakeRuntime:
    """``torch.cuda.cudart()`` standing in for the driver: records registrations and
    refuses the ``refuse``-th one (1-based; 0: none)."""

    def __init__(self, refuse: int = 0) -> None:
        self.refuse = refuse
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, addr: int, n: int, flags: int) -> Any:  # noqa: N802 (the runtime's name)
        if len(self.registered) + 1 == self.refuse:
            return SimpleNamespace(value=1)
        self.registered.append((addr, n))
        return SimpleNamespace(value=0)

    def cudaHostUnregister(self, addr: int) -> Any:  # noqa: N802
        self.unregistered.append(addr)
        return SimpleNamespace(value=0)


def _slab_file(tmp_path: Path, nbytes: int) -> int:
    fd = os.open(tmp_path / "slab", os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    return fd


def test_a_mapping_is_populated_in_steps_and_page_locked_once_until_the_last_view_goes(tmp_path, monkeypatch):
    runtime = FakeRuntime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    rests: list[float] = []
    nbytes = 4 * STEP + 4096
    mapped = host_map.MappedMemory(_slab_file(tmp_path, nbytes), nbytes, pinned=True, step=STEP, between=rests.append)
    assert runtime.registered == [(mapped.address, nbytes)] and mapped.pinned
    assert len(rests) == 4  # (a rest between populating steps, none after the last)
    view = mapped.tensor[STEP - 8 : STEP + 8]
    view.fill_(7)
    del mapped
    assert runtime.unregistered == []  # a view is left: nothing is unlocked under it
    assert int(view.sum()) == 7 * 16
    del view
    assert runtime.unregistered == [runtime.registered[0][0]]


def test_a_refused_page_lock_of_a_stepped_mapping_leaves_nothing_mapped(tmp_path, monkeypatch):
    runtime = FakeRuntime(refuse=1)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    monkeypatch.setattr(host_map, "clear_cuda_error", lambda: True)
    fd = _slab_file(tmp_path, 4 * STEP)
    with pytest.raises(RuntimeError, match=f"cudaHostRegister of {4 * STEP} bytes failed: error 1"):
        host_map.MappedMemory(fd, 4 * STEP, pinned=True, step=STEP)
    assert runtime.registered == [] and runtime.unregistered == []
    with pytest.raises(OSError):  # the mapping owned the descriptor, and closed it
        os.fstat(fd)


# ------------------------------------------------------------------ the preparer's rests


@pytest.fixture
def stepped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FastTier, list[str], threading.Event]]:
    """A tier whose slabs are made in 4 steps, whose preparer's rests last until hurried;
    yields it, the names of the threads that rested, and an Event set at the first rest."""
    monkeypatch.setattr(slab_prep, "STEP_BYTES", STEP)
    monkeypatch.setattr(slab_prep, "REST_FACTOR", 1e9)
    rested: list[str] = []
    resting = threading.Event()
    real = SlabPreparer.rest

    def rest(self: SlabPreparer, busy_s: float) -> None:
        rested.append(threading.current_thread().name)
        resting.set()
        real(self, max(busy_s, 1e-6))  # (endless until hurried: 1e9 x the step's time)

    monkeypatch.setattr(SlabPreparer, "rest", rest)
    tier = FastTier.open(tmp_path / "fast", create=True, config=cfg(fast_tier_bytes=16 * MiB))
    try:
        yield tier, rested, resting
    finally:
        tier.close()


def test_a_slab_a_save_makes_itself_has_no_rests(stepped):
    tier, rested, _resting = stepped
    tier.set_budget(1, SLAB, 256 * KiB)
    txn = tier.begin_write()
    try:
        assert txn.reserve(SLAB // 2, 256 * KiB)
        _slab, _offset, memory = txn.take(256 * KiB)
        memory.fill_(3)
    finally:
        txn.abort()
    assert rested == []


def test_a_thread_waiting_for_the_slab_in_hand_ends_the_preparers_rests(stepped):
    tier, rested, resting = stepped
    tier.prepare_ahead(SLAB)
    assert resting.wait(HANG_S), "the preparer never rested"
    waiter, out = in_thread(lambda: tier.slab_memory(0))
    waiter.join(HANG_S)
    assert not waiter.is_alive(), "the waiter waited out the preparer's rests"
    assert "error" not in out and out["value"].numel() == SLAB
    assert set(rested) == {"gpusnap-slab-prep"}
    tier.wait_prepared(HANG_S)  # (made by the preparer, once)
    assert tier.prepared_bytes() == SLAB


def test_close_ends_a_rest_and_the_preparer_with_it(stepped):
    tier, _rested, resting = stepped
    tier.prepare_ahead(2 * SLAB)
    assert resting.wait(HANG_S), "the preparer never rested"
    tier.close()
    tier._preparer.join(HANG_S)
    assert not tier._preparer.busy(), "close() left the preparer resting"


def test_waiting_for_the_whole_preparation_ends_the_rests(stepped):
    tier, rested, resting = stepped
    tier.prepare_ahead(2 * SLAB)
    assert resting.wait(HANG_S), "the preparer never rested"
    waiter, out = in_thread(lambda: tier.wait_prepared())  # (prepare(wait=True)'s wait)
    waiter.join(HANG_S)
    assert not waiter.is_alive(), "wait_prepared() waited out the preparer's rests"
    assert "error" not in out and tier.prepared_bytes() == 2 * SLAB
