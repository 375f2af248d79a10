"""Slab preparation ahead of use: :class:`SlabPreparer` (one background thread, slabs in
the order wanted, errors kept and logged, never raised), ``FastTier.slab_memory`` (one
thread prepares a slab, the others wait for it, and try themselves if it failed) and
``FastTier.prepare_ahead`` (slabs added up to a size, within the tier's capacity).

Deterministic: every wait is on an Event a fake sets (bounded by ``HANG_S``, which only a
hang reaches); no sleeps, no timing bounds.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fast_support import HANG_S, cfg, in_thread

from gpusnap.errors import StorageError
from gpusnap.storage import fast_tier, slab_files
from gpusnap.storage.fast_tier import FastTier, slab_path
from gpusnap.storage.slab_prep import SlabPreparer

MiB = 1 << 20
SLAB = 2 * MiB  # fast_support's fast_slab_bytes


class Recorder:
    """A ``prepare`` callable: records each slab, blocks on slabs in ``hold`` until
    :meth:`release`, raises for slabs in ``fail``."""

    def __init__(self, *, hold: tuple[int, ...] = (), fail: tuple[int, ...] = ()) -> None:
        self.hold, self.fail = set(hold), set(fail)
        self.done: list[int] = []
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.threads: list[threading.Thread] = []

    def __call__(self, slab: int) -> None:
        self.threads.append(threading.current_thread())
        if slab in self.hold:
            self.entered.set()
            assert self.opened.wait(HANG_S), "never released"
        if slab in self.fail:
            raise OSError(28, f"no space for slab {slab}")
        self.done.append(slab)

    def wait_entered(self) -> None:
        assert self.entered.wait(HANG_S), "the preparer never reached a held slab"

    def release(self) -> None:
        self.opened.set()


@pytest.fixture
def recorders() -> Iterator[list[Recorder]]:
    """Recorders whose holds are released at the end whatever happens (no thread left blocked)."""
    made: list[Recorder] = []
    yield made
    for r in made:
        r.release()


def _recorder(made: list[Recorder], **kw: Any) -> Recorder:
    r = Recorder(**kw)
    made.append(r)
    return r


# ---------------------------------------------------------------------- SlabPreparer


def test_slabs_are_prepared_in_the_order_wanted_on_one_daemon_thread(recorders: list[Recorder]) -> None:
    rec = _recorder(recorders, hold=(3,))  # (held: the thread is still at work at the second want)
    prep = SlabPreparer(rec)
    prep.want([3, 1, 2])
    rec.wait_entered()
    prep.want([0])
    rec.release()
    prep.join()
    assert rec.done == [3, 1, 2, 0]
    assert prep.prepared == 4 and prep.errors == []
    assert len({t.ident for t in rec.threads}) == 1
    thread = rec.threads[0]
    assert thread is not threading.main_thread() and thread.daemon and thread.name == "gpusnap-slab-prep"


def test_a_slab_wanted_again_while_queued_is_prepared_once(recorders: list[Recorder]) -> None:
    rec = _recorder(recorders, hold=(0,))
    prep = SlabPreparer(rec)
    prep.want([0])
    rec.wait_entered()  # slab 0 in hand: what follows queues behind it
    prep.want([2, 1, 2])
    prep.want([1, 3, 2])
    rec.release()
    prep.join()
    assert rec.done == [0, 2, 1, 3]
    assert prep.prepared == 4


def test_a_failed_slab_is_recorded_and_logged_not_raised_and_the_slabs_after_it_wait_for_a_later_want(
    recorders: list[Recorder], caplog: pytest.LogCaptureFixture
) -> None:
    """A full tmpfs: slab 2 made after slab 1 failed would take the room slab 1, which a save
    takes first, needs once space is back; so slab 2 waits for the next want()."""
    rec = _recorder(recorders, fail=(1,))
    prep = SlabPreparer(rec)
    with caplog.at_level(logging.WARNING, logger="gpusnap"):
        prep.want([0, 1, 2])  # (want never raises: the error is the thread's)
        prep.join()
    assert rec.done == [0]
    assert prep.prepared == 1
    assert len(prep.errors) == 1 and prep.errors[0].startswith("slab 1: ") and "no space for slab 1" in prep.errors[0]
    warned = [r for r in caplog.records if r.name == "gpusnap" and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "slab 1" in warned[0].getMessage()
    assert not prep.busy()
    prep.want([1, 2])  # wanted again (a later save's prepare_ahead): 1 fails again, 2 still waits
    prep.join()
    assert len(prep.errors) == 1 and rec.done == [0]  # one line per slab, warned once
    rec.fail = ()  # space is back
    prep.want([1, 2])
    prep.join()
    assert rec.done == [0, 1, 2] and prep.errors == []
    assert len([r for r in caplog.records if r.name == "gpusnap" and r.levelno == logging.WARNING]) == 1


def test_stop_drops_queued_slabs_finishes_the_one_in_hand_and_refuses_later_wants(recorders: list[Recorder]) -> None:
    rec = _recorder(recorders, hold=(0,))
    prep = SlabPreparer(rec)
    prep.want([0, 1, 2])
    rec.wait_entered()
    prep.stop()  # returns at once (close() may run on any thread: it never waits), slab 0 in hand
    assert prep.busy() and rec.done == []
    rec.release()
    prep.join()
    assert rec.done == [0]
    assert not prep.busy()
    prep.want([5, 6])
    assert not prep.busy()  # no thread started
    prep.join()
    assert rec.done == [0] and prep.prepared == 1


def test_busy_while_there_is_work_and_join_waits_for_all_of_it(recorders: list[Recorder]) -> None:
    rec = _recorder(recorders, hold=(0,))
    prep = SlabPreparer(rec)
    assert not prep.busy()
    prep.join()  # nothing wanted: returns at once
    prep.want([])
    assert not prep.busy()  # no work, no thread
    prep.want([0, 1])
    rec.wait_entered()
    assert prep.busy()
    assert rec.done == []
    rec.release()
    prep.join()
    assert rec.done == [0, 1]
    assert not prep.busy()
    prep.want([2])  # the thread is gone; new work starts a new one
    prep.join()
    assert rec.done == [0, 1, 2] and not prep.busy()


# ---------------------------------------------------------------------- FastTier.slab_memory


class _FakeMap:
    def __init__(self, slab: int, nbytes: int = 4096) -> None:
        self.slab = slab
        self.nbytes = nbytes
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8)


class FakeMaker:
    """Stands for ``FastTier.make_slab``: counts calls, blocks the first call on a held
    slab until :meth:`release`, and raises the errors in ``errors`` (one per call, in turn;
    None: succeeds)."""

    def __init__(self, *, hold: tuple[int, ...] = (), errors: list[BaseException | None] | None = None) -> None:
        self.hold = set(hold)
        self.errors = list(errors or [])
        self.calls: list[tuple[int, str]] = []
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.made: list[_FakeMap] = []

    def __call__(self, tier: FastTier, slab: int) -> _FakeMap:
        first = not self.calls
        self.calls.append((slab, threading.current_thread().name))
        if first and slab in self.hold:
            self.entered.set()
            assert self.opened.wait(HANG_S), "never released"
        error = self.errors.pop(0) if self.errors else None
        if error is not None:
            raise error
        m = _FakeMap(slab)
        self.made.append(m)
        return m

    def release(self) -> None:
        self.opened.set()

    def method(self) -> Callable[[FastTier, int], _FakeMap]:
        """This fake as a function, to patch onto the class (an instance would not bind)."""

        def make_slab(tier: FastTier, slab: int) -> _FakeMap:
            return self(tier, slab)

        return make_slab


class SpyEvent(threading.Event):
    """An Event that says when a thread starts waiting on it (the slab's waiter)."""

    waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        type(self).waiting.set()
        return super().wait(timeout)


class _Threading:
    """``slab_files``' view of :mod:`threading`, with :class:`SpyEvent` for its Events."""

    Event = SpyEvent

    def __getattr__(self, name: str) -> Any:
        return getattr(threading, name)


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[FastTier]:
    t = FastTier.open(tmp_path / "fast", create=True, config=cfg(fast_tier_bytes=16 * MiB))
    yield t
    t.close()
    t._preparer.join()


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> type[SpyEvent]:
    monkeypatch.setattr(SpyEvent, "waiting", threading.Event())
    monkeypatch.setattr(slab_files, "threading", _Threading())
    return SpyEvent


def _joined(*threads: threading.Thread) -> None:
    for t in threads:
        t.join(HANG_S)
        assert not t.is_alive(), f"{t.name} hung"


def test_two_threads_wanting_one_slab_make_it_once_and_get_the_same_tensor(
    tier: FastTier, monkeypatch: pytest.MonkeyPatch, spy: type[SpyEvent]
) -> None:
    maker = FakeMaker(hold=(0,))
    monkeypatch.setattr(FastTier, "make_slab", maker.method())
    try:
        first, a = in_thread(lambda: tier.slab_memory(0))
        assert maker.entered.wait(HANG_S)  # the first thread is making slab 0
        second, b = in_thread(lambda: tier.slab_memory(0))
        assert spy.waiting.wait(HANG_S)  # the second waits for the first's preparation
        assert len(maker.calls) == 1
    finally:
        maker.release()
    _joined(first, second)
    assert "error" not in a and "error" not in b, (a, b)
    assert len(maker.calls) == 1
    assert a["value"] is b["value"] is maker.made[0].tensor
    assert tier.slab_memory(0) is a["value"]  # mapped: no new preparation
    assert len(maker.calls) == 1
    assert tier._preparing == {}
    assert tier.prepared_bytes() == maker.made[0].nbytes
    assert not tier.unprepared([0]) and tier.unprepared([0, 1])


def test_a_waiter_prepares_the_slab_itself_when_the_first_preparation_failed(
    tier: FastTier, monkeypatch: pytest.MonkeyPatch, spy: type[SpyEvent]
) -> None:
    maker = FakeMaker(hold=(0,), errors=[OSError(28, "first: no space"), None])
    monkeypatch.setattr(FastTier, "make_slab", maker.method())
    try:
        first, a = in_thread(lambda: tier.slab_memory(0))
        assert maker.entered.wait(HANG_S)
        second, b = in_thread(lambda: tier.slab_memory(0))
        assert spy.waiting.wait(HANG_S)
    finally:
        maker.release()
    _joined(first, second)
    assert isinstance(a.get("error"), OSError) and "first: no space" in str(a["error"])
    assert "error" not in b, b
    assert [c[0] for c in maker.calls] == [0, 0]  # the waiter tried itself, once
    assert b["value"] is maker.made[0].tensor
    assert tier._preparing == {} and not tier.unprepared([0])


def test_a_waiter_whose_own_try_fails_too_raises_its_own_error(
    tier: FastTier, monkeypatch: pytest.MonkeyPatch, spy: type[SpyEvent]
) -> None:
    maker = FakeMaker(hold=(0,), errors=[OSError(28, "first: no space"), OSError(12, "second: no memory")])
    monkeypatch.setattr(FastTier, "make_slab", maker.method())
    try:
        first, a = in_thread(lambda: tier.slab_memory(0))
        assert maker.entered.wait(HANG_S)
        second, b = in_thread(lambda: tier.slab_memory(0))
        assert spy.waiting.wait(HANG_S)
    finally:
        maker.release()
    _joined(first, second)
    assert "first: no space" in str(a["error"])
    assert isinstance(b.get("error"), OSError) and "second: no memory" in str(b["error"])
    assert len(maker.calls) == 2
    assert tier._preparing == {} and tier.unprepared([0])
    # nothing is left marked busy: a third caller makes it (and succeeds)
    assert tier.slab_memory(0) is maker.made[0].tensor
    assert len(maker.calls) == 3


def test_the_background_preparer_and_a_save_share_one_preparation(
    tier: FastTier, monkeypatch: pytest.MonkeyPatch, spy: type[SpyEvent]
) -> None:
    maker = FakeMaker(hold=(0,))
    monkeypatch.setattr(FastTier, "make_slab", maker.method())
    try:
        tier.prepare_ahead(SLAB)
        assert maker.entered.wait(HANG_S)
        assert maker.calls == [(0, "gpusnap-slab-prep")]
        save, out = in_thread(lambda: tier.slab_memory(0))  # the copier, taking slab 0
        assert spy.waiting.wait(HANG_S)
    finally:
        maker.release()
    _joined(save)
    tier._preparer.join()
    assert out["value"] is maker.made[0].tensor
    assert len(maker.calls) == 1 and tier._preparer.prepared == 1


# ---------------------------------------------------------------------- FastTier.prepare_ahead


def _slab_files(tier: FastTier) -> list[tuple[str, int]]:
    d = Path(tier.backend.local_path(fast_tier.SLABS))  # type: ignore[attr-defined]
    return sorted((p.name, p.stat().st_size) for p in d.iterdir())


def test_prepare_ahead_creates_and_maps_slabs_up_to_the_bytes_asked(tier: FastTier) -> None:
    assert tier.prepared_bytes() == 0 and _slab_files(tier) == []
    want = 5 * MiB
    added = tier.prepare_ahead(want)
    tier._preparer.join()
    assert added == 3 * SLAB  # whole 2 MiB slabs
    assert _slab_files(tier) == [(f"{i:06d}.slab", SLAB) for i in range(3)]
    assert tier.prepared_bytes() >= want
    assert tier.prepared_bytes() == 3 * SLAB <= tier.capacity()
    assert not tier.unprepared([0, 1, 2])
    assert tier._preparer.errors == [] and tier._preparer.prepared == 3
    # enough already: nothing added, nothing to prepare
    assert tier.prepare_ahead(want) == 0
    assert not tier._preparer.busy()
    assert tier.prepared_bytes() == 3 * SLAB
    # more: only the missing slab is added (and only it prepared)
    assert tier.prepare_ahead(7 * MiB) == SLAB
    tier._preparer.join()
    assert len(_slab_files(tier)) == 4 and tier.prepared_bytes() == 4 * SLAB
    assert tier._preparer.prepared == 4
    for name, _n in _slab_files(tier):
        assert tier.backend.exists(slab_path(int(name[:-5])))


def test_prepare_ahead_stops_at_the_tiers_capacity_without_raising(tmp_path: Path) -> None:
    tier = FastTier.open(tmp_path / "fast", create=True, config=cfg(fast_tier_bytes=5 * MiB))
    try:
        added = tier.prepare_ahead(20 * MiB)
        tier._preparer.join()
        assert added == 2 * SLAB  # a third 2 MiB slab would pass the 5 MiB capacity
        assert _slab_files(tier) == [("000000.slab", SLAB), ("000001.slab", SLAB)]
        assert tier.prepared_bytes() == 2 * SLAB <= tier.capacity()
        assert tier.prepare_ahead(20 * MiB) == 0  # full: still no error
        assert tier._preparer.errors == []
    finally:
        tier.close()
        tier._preparer.join()


def test_prepare_ahead_counts_the_slabs_a_save_already_reserved(tier: FastTier) -> None:
    txn = tier.begin_write()
    try:
        assert txn.reserve(1 * MiB, 256 * 1024)  # one new 2 MiB slab, not made yet
        assert [e.slab for e in txn.extents] == [0] and _slab_files(tier) == []
        assert tier.unprepared([0])
        assert tier.prepare_ahead(3 * MiB) == SLAB  # slab 0 counts: only slab 1 is added
        tier._preparer.join()
        assert not tier.unprepared([0, 1])  # both prepared, slab 0 included (the save's own)
        assert _slab_files(tier) == [("000000.slab", SLAB), ("000001.slab", SLAB)]
    finally:
        txn.abort()


def test_a_slab_the_preparer_cannot_make_is_left_to_its_user_who_meets_the_error(
    tier: FastTier, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = FastTier.make_slab
    failures: list[int] = []

    def flaky(self: FastTier, slab: int) -> Any:
        if slab == 1 and not failures:
            failures.append(slab)
            raise OSError(28, "No space left on device")
        return real(self, slab)

    monkeypatch.setattr(FastTier, "make_slab", flaky)
    with caplog.at_level(logging.WARNING, logger="gpusnap"):
        tier.prepare_ahead(3 * SLAB)  # never raises
        tier._preparer.join()
    assert len(tier._preparer.errors) == 1 and tier._preparer.errors[0].startswith("slab 1: ")
    assert any("slab 1" in r.getMessage() for r in caplog.records if r.name == "gpusnap")
    assert tier.unprepared([1]) and tier.unprepared([2]) and not tier.unprepared([0])  # 2 waits: see above
    assert tier._preparer.prepared == 1
    assert tier.slab_memory(1).numel() == SLAB  # its user tries again (and here succeeds)
    assert not tier.unprepared([0, 1]) and tier.unprepared([2])
    tier.prepare_ahead(3 * SLAB)  # the next save's want
    tier._preparer.join()
    assert not tier.unprepared([0, 1, 2]) and tier._preparer.errors == []


def test_close_stops_the_preparer_mid_way(tier: FastTier, monkeypatch: pytest.MonkeyPatch) -> None:
    maker = FakeMaker(hold=(0,))
    monkeypatch.setattr(FastTier, "make_slab", maker.method())
    try:
        tier.prepare_ahead(3 * SLAB)
        assert maker.entered.wait(HANG_S)
        tier.close()  # returns at once, slab 0 still in hand
        assert tier._preparer.busy()
    finally:
        maker.release()
    tier._preparer.join()
    assert tier._maps == {}  # made after close(): not kept (its caller's tensor would hold it)
    assert [c[0] for c in maker.calls] == [0]  # slabs 1 and 2 were dropped
    assert tier.unprepared([1, 2])
    tier.prepare_ahead(4 * SLAB)  # a closed tier prepares nothing more
    assert not tier._preparer.busy()
    assert [c[0] for c in maker.calls] == [0]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_interrupt_in_a_preparation_ends_the_thread_cleanly_and_later_wants_start_a_new_one(
    recorders: list[Recorder],
) -> None:
    calls: list[int] = []

    def prepare(slab: int) -> None:
        calls.append(slab)
        if slab == 0:
            raise KeyboardInterrupt

    prep = SlabPreparer(prepare)
    prep.want([0, 1])
    prep.join()
    assert not prep.busy()
    prep.want([2])
    prep.join()
    assert calls[0] == 0 and calls[-1] == 2


def test_prepare_ahead_makes_ready_only_the_lowest_slabs_that_hold_the_bytes_and_skips_empty_files(
    tier: FastTier,
) -> None:
    slabs = tier.backend.local_path("slabs")
    for k, size in enumerate((0, SLAB, SLAB, SLAB)):  # slab 0: a writer killed before allocating it
        with open(os.path.join(slabs, f"{k:06d}.slab"), "wb") as f:
            f.truncate(size)
    tier._slab_sizes = {}
    tier.prepare_ahead(SLAB)
    tier._preparer.join()
    assert tier._preparer.errors == []
    assert sorted(tier._maps) == [1]  # not the empty slab 0, not slabs 2 and 3 (left by a larger state)


def test_wait_prepared_raises_only_for_slabs_still_wanted_and_unmade(tier: FastTier, monkeypatch: pytest.MonkeyPatch) -> None:
    real = FastTier.make_slab

    def no_room_for_2(self: FastTier, slab: int) -> Any:
        if slab == 2:
            raise OSError(28, "No space left on device")
        return real(self, slab)

    monkeypatch.setattr(FastTier, "make_slab", no_room_for_2)
    tier.prepare_ahead(3 * SLAB)
    with pytest.raises(StorageError, match="slab 2: .*No space left"):
        tier.wait_prepared()
    tier.prepare_ahead(2 * SLAB)  # a smaller state later: slabs 0 and 1 are all it wants, and are made
    tier.wait_prepared()
    assert tier._preparer.errors  # (still in the saves' stats: slab 2 was never made)
