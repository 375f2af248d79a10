"""Issue 4 on CPU: unseen writes are caught by the device-side hashes (never committed wrong),
offenders are captured at save() afterwards, and unchanged chunks are neither copied nor
written again (incremental saves)."""

from __future__ import annotations

import random
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from capture_support import StoreGate
from faults import HANG_S, wait_until

import gpusnap
from gpusnap.capture.window import buffers_from
from gpusnap.kernels.chunk_hash import chunk_hashes, hashes_to_hex
from gpusnap.save import saves
from gpusnap.storage.repository import Repository

CHUNK = 512


def _config(**kw: Any) -> gpusnap.Config:
    base: dict[str, Any] = {"chunk_size": CHUNK, "staging_bytes": 4 * CHUNK, "pack_size": 1 << 16,
                            "io_threads": 2, "eager_cpu_bytes": 0, "cpu_snapshot_bytes": 0, "fsync": False}
    base.update(kw)
    return gpusnap.Config(**base)


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[StoreGate]:
    """Chunk stores wait until released: the copier stalls with later spans still pending."""
    gate = StoreGate(held=True)
    gate.install(monkeypatch)
    yield gate
    gate.release()


def _state() -> dict[str, torch.Tensor]:
    return {"a": torch.randn(2048), "b": torch.randn(1024), "c": torch.arange(300, dtype=torch.int64)}


def test_unseen_write_fails_the_save_then_is_captured_eagerly(tmp_path: Any, held: StoreGate) -> None:
    state = _state()
    before = {k: v.clone() for k, v in state.items()}
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config(retry_validation=False)) as ck:
        pending = ck.save(state)
        state["b"].numpy()[7] = 1234.5  # numpy view: the dispatcher (the tracker) never sees it
        held.release()
        with pytest.raises(gpusnap.ValidationError, match="b"):
            pending.wait()
        assert ck.list() == [], "a save that failed validation commits nothing"
        state["b"].copy_(before["b"])
        # the offender is now copied at save(): the same unseen write cannot reach the checkpoint
        held.hold()
        pending = ck.save(state)
        state["b"].numpy()[7] = -1.0
        held.release()
        info = pending.wait()
        assert info.stats["bytes_eager"] == state["b"].numel() * 4
        assert info.stats["validation"].startswith("ok")
        ck.restore(state, info.id)
    for k in state:
        assert torch.equal(state[k], before[k]), k


def test_without_validation_the_unseen_write_is_committed(tmp_path: Any, held: StoreGate) -> None:
    """The documented risk of validate=False, shown: the same schedule commits a wrong byte."""
    state = _state()
    expected = state["b"].clone()
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config(validate=False)) as ck:
        pending = ck.save(state)
        state["b"].numpy()[7] = 1234.5
        held.release()
        info = pending.wait()
        assert info.stats["validation"].startswith("off")
        fresh = {k: torch.zeros_like(v) for k, v in state.items()}
        ck.restore(fresh, info.id)
    assert not torch.equal(fresh["b"], expected)


@pytest.mark.parametrize("seed", range(6))
def test_random_numpy_writes_are_never_committed_wrong(tmp_path: Any, seed: int) -> None:
    rng = random.Random(seed)
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config(staging_bytes=1 << 16)) as ck:
        state = {f"t{i}": torch.randn(rng.choice([64, 700, 2048])) for i in range(5)}
        for _ in range(12):
            expected = {k: v.clone() for k, v in state.items()}
            pending = ck.save(state)
            victim = state[rng.choice(sorted(state))]
            victim.numpy()[rng.randrange(victim.numel())] += 1.0  # unseen, at a random moment
            now = {k: v.clone() for k, v in state.items()}  # what a retry (inside wait) sees
            try:
                info = pending.wait()
            except gpusnap.ValidationError:
                continue  # caught, and the retry failed too: fine, nothing committed
            if "a retry" in info.stats["validation"]:
                expected = now  # caught, then retried at wait(): the retry's consistent point
            fresh = {k: torch.zeros_like(v) for k, v in state.items()}
            ck.restore(fresh, info.id)
            for k in state:
                assert torch.equal(fresh[k], expected[k]), f"seed {seed}: {k} committed wrong"


def test_unchanged_chunks_are_not_copied_again(tmp_path: Any) -> None:
    state = {"frozen": torch.randn(16 * CHUNK // 4), "cache": torch.zeros(8 * CHUNK // 4)}
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config(staging_bytes=1 << 16)) as ck:
        first = ck.save(state).wait()
        assert first.stats["bytes_copied"] == first.stats["bytes_total"]
        second = ck.save(state).wait()
        assert second.stats["bytes_copied"] == 0 and second.stats["bytes_skipped"] == second.stats["bytes_total"]
        state["cache"][: CHUNK // 4 + 1] = 7.0  # touches chunks 0 and 1 of "cache" only
        expected = {k: v.clone() for k, v in state.items()}
        third = ck.save(state).wait()
        assert third.stats["bytes_copied"] == 2 * CHUNK
        assert third.stats["bytes_written"] == 2 * CHUNK
        fresh = {k: torch.full_like(v, -1.0) for k, v in state.items()}
        ck.restore(fresh, third.id)
    for k in state:
        assert torch.equal(fresh[k], expected[k]), k


def test_incremental_continues_from_the_root_in_a_new_checkpointer(tmp_path: Any) -> None:
    state = {"w": torch.randn(4 * CHUNK)}
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config(staging_bytes=1 << 16)) as ck:
        ck.save(state).wait()
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config(staging_bytes=1 << 16)) as ck:
        info = ck.save(state).wait()
    assert info.stats["bytes_copied"] == 0


def test_manifest_records_the_consistent_point_hashes(tmp_path: Any) -> None:
    state = {"x": torch.randn(3 * CHUNK // 4 + 5)}
    expected = hashes_to_hex(chunk_hashes(state["x"].view(torch.uint8), CHUNK))
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config()) as ck:
        pending = ck.save(state)
        state["x"].add_(1)  # a tracked write after save(): the hashes are those at save()
        info = pending.wait()
    manifest = Repository.open(str(tmp_path / "ck")).resolve(info.id)
    assert list(manifest.storages[0].hashes) == expected


def test_a_failed_validation_is_retried_once_at_the_next_call(tmp_path: Any, held: StoreGate) -> None:
    state = _state()
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config(retry_validation=True)) as ck:
        pending = ck.save(state)
        state["b"].numpy()[3] = 99.0  # unseen write: this attempt fails validation
        held.release()
        retried_from = {k: v.clone() for k, v in state.items()}  # the retry's consistent point
        info = pending.wait()  # the retry starts here, on the saving thread, and succeeds
        assert info.id == pending.id and "a retry" in info.stats["validation"]
        # the info says its state is from the retry, a later point than the save() call
        assert info.stats["consistent_point"] == "retry" and info.stats["save_called"] < info.created
        assert info.stats["bytes_eager"] == state["b"].numel() * 4
        fresh = {k: torch.zeros_like(v) for k, v in state.items()}
        ck.restore(fresh, info.id)
    for k in state:
        assert torch.equal(fresh[k], retried_from[k]), k


def test_a_retried_blocking_save_reports_the_callers_whole_wait(
    tmp_path: Any, held: StoreGate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Device state's blocking saves go through a window; one that fails validation is retried
    inside the caller's wait, and its stall_s is the whole wait, first attempt included."""
    # private: blocking saves of host state take the stop-the-world path, and no Config knob
    # sends them through a window (only device state does); a non-blocking save's stall_s is
    # save()'s own, so it cannot show a blocking caller's whole wait
    monkeypatch.setattr(saves, "_blocking_via_window", lambda flat: True)
    state = _state()
    storing = held.entered  # the first attempt's copier has handed a piece of "a" to a writer

    def unseen_write_then_release() -> None:
        # inside the first attempt, which the caller waits through: its copier stalls in "a"
        # (the stores are held, staging holds 4 chunks), so "b" is not copied yet
        assert storing.wait(HANG_S)
        state["b"].numpy()[3] = 99.0
        time.sleep(0.5)  # a duration the caller's stall must include (not an ordering device)
        held.release()

    with gpusnap.Checkpointer(tmp_path / "ck", config=_config(retry_validation=True)) as ck:
        held.release()
        ck.save(state).wait()  # the first window of a Checkpointer is tracked anyway
        held.hold()
        storing.clear()
        for v in state.values():
            v.add_(1)  # every chunk changed: none is skipped, the copier stalls on staging
        writer = threading.Thread(target=unseen_write_then_release)
        writer.start()
        info = ck.save(state, blocking=True).wait()
        writer.join()
    assert "a retry" in info.stats["validation"]
    assert info.stats["stall_s"] >= 0.5, info.stats["stall_s"]


@pytest.mark.parametrize("snapshot", [True, False], ids=["snapshot", "tracked"])
def test_incremental_compares_only_where_it_pays(tmp_path: Any, snapshot: bool) -> None:
    """Training (every chunk changes): after one comparison that finds nothing unchanged, saves
    copy at once (no wait for the hashes), and each one still learns the unchanged share from
    its own hashes. Once the state freezes, the first save copies at once but finds it all
    unchanged, so the next one compares and skips. Every checkpoint restores exactly."""
    config = _config(cpu_snapshot_bytes=(1 << 20) if snapshot else 0)  # whole-state snapshot, or tracked
    g = torch.Generator().manual_seed(11)
    state = {"w": torch.randn(4096, generator=g), "m": torch.randn(2048, generator=g)}
    total = sum(v.nbytes for v in state.values())
    notes, expected, ids = [], [], []
    with gpusnap.Checkpointer(tmp_path / "ck", config=config) as ck:
        for step in range(7):  # training: everything changes between saves...
            for name, t in state.items():
                if step == 4 and name == "w":  # ...except once: "w" is left as it was
                    continue
                t.add_(torch.randn(t.shape, generator=g))
            expected.append({k: v.clone() for k, v in state.items()})
            info = ck.save(state).wait()
            notes.append(info.stats["incremental"])
            ids.append(info.id)
            assert info.stats["tracked"] is not snapshot or len(ids) == 1  # a first window is tracked
        # save 1: nothing to compare with; 2 compares (0% unchanged); 3, 4 copy at once;
        # 5 copies at once but finds "w" (2/3 of the bytes) unchanged; so 6 compares
        # (0% again), and 7 copies at once
        compared = [note.startswith("compared") for note in notes]  # what each save did
        assert compared == [False, True, False, False, False, True, False], notes
        assert notes[0] == "nothing to compare with"
        assert notes[1].startswith("compared") and "0.0%" in notes[1]
        assert notes[2].startswith("not compared") and "found 0.0%" in notes[2], notes[2]
        assert f"found {state['w'].nbytes / total:.1%}" in notes[4], notes[4]
        assert notes[5].startswith("compared") and "0.0%" in notes[5]
        frozen = []
        for _ in range(3):  # frozen: the first copies at once, then every save compares and skips
            info = ck.save(state).wait()
            frozen.append(info.stats["incremental"])
            if len(frozen) > 1:
                assert frozen[-1].startswith("compared"), frozen
                assert info.stats["bytes_skipped"] == total
        assert frozen[0].startswith("not compared") and "found 100.0%" in frozen[0], frozen
        for cid, want in zip(ids, expected):
            got = {k: torch.zeros_like(v) for k, v in state.items()}
            ck.restore(got, cid)
            assert all(torch.equal(got[k], want[k]) for k in want), cid


def test_uncompared_saves_hash_the_snapshot_not_the_live_state(tmp_path: Any, device: torch.device) -> None:
    """An incremental save that does not compare (training: nothing was unchanged last time)
    hashes its snapshots after issuing its copies, off their path. The hashes must still be
    those of the consistent point: the program overwrites every tensor right after save(),
    and the manifest's hashes must equal those of the saved bytes (a restore checks its
    bytes against them, and the next comparison trusts them)."""
    g = torch.Generator(device=device).manual_seed(5)
    state = {f"t{i}": torch.randn(1 << 14, device=device, generator=g) for i in range(4)}
    config = _config(cpu_snapshot_bytes=1 << 24, device_snapshot=True, staging_bytes=1 << 20)
    with gpusnap.Checkpointer(tmp_path / "ck", config=config) as ck:
        for _ in range(3):  # 1: nothing to compare with; 2: compares (0% unchanged); 3: copies at once
            for t in state.values():
                t.normal_(generator=g)
            expected = {k: v.clone() for k, v in state.items()}
            pending = ck.save(state)
            for _ in range(20):  # overwrite the live bytes while the copier works
                for t in state.values():
                    t.mul_(1.0001).add_(1.0)
            info = pending.wait()
        assert info.stats["incremental"].startswith("not compared"), info.stats["incremental"]
        assert not info.stats["tracked"] and info.stats["bytes_snapshot"] == sum(v.nbytes for v in state.values())
        manifest = Repository.open(str(tmp_path / "ck")).load_manifest(info.id)
        for entry, name in zip(manifest.storages, expected):
            assert entry.hashes is not None
            assert list(entry.hashes) == hashes_to_hex(chunk_hashes(expected[name].view(torch.uint8), CHUNK)), name
        got = {k: torch.zeros_like(v) for k, v in state.items()}
        ck.restore(got, info.id)
        assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.fixture
def snapshot_refs() -> Iterator[list[Any]]:
    """Weak references to every snapshot (and shadow) buffer the saves take from now on."""
    refs: list[Any] = []

    def watched(nbytes: int, device: torch.device) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        refs.append(weakref.ref(buffer))
        return buffer

    with buffers_from(watched):
        yield refs


@pytest.mark.parametrize("incremental", [False, True])
def test_snapshots_are_freed_once_committed(tmp_path: Any, snapshot_refs: list[Any], incremental: bool) -> None:
    """A whole-state snapshot is as big as the state: nothing may hold it after the save is
    durable (compared, uncompared and plain saves alike), or the next save's snapshot finds
    half the memory and the program may run out."""
    import gc

    state = {f"t{i}": torch.randn(4096) for i in range(4)}
    config = _config(cpu_snapshot_bytes=1 << 24, staging_bytes=1 << 20, incremental=incremental)
    with gpusnap.Checkpointer(tmp_path / "ck", config=config) as ck:
        for _ in range(3):  # incremental: nothing to compare with, compared, not compared
            for t in state.values():
                t.add_(1.0)
            ck.save(state).wait()
            gc.collect()
            assert snapshot_refs and all(r() is None for r in snapshot_refs), "a snapshot outlived its save"
            snapshot_refs.clear()


def test_a_failed_uncompared_save_frees_its_snapshot(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                     snapshot_refs: list[Any]) -> None:
    """An uncompared save keeps its snapshot for the hash at commit; if its writes fail
    (a full disk), the snapshot must go back all the same."""
    import gc

    disk = StoreGate(held=False)
    disk.install(monkeypatch)
    state = {f"t{i}": torch.randn(4096) for i in range(4)}
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config(cpu_snapshot_bytes=1 << 24, staging_bytes=1 << 20)) as ck:
        for _ in range(2):  # nothing to compare with; compared (0% unchanged)
            for t in state.values():
                t.add_(1.0)
            ck.save(state).wait()
        snapshot_refs.clear()
        disk.fail_stores_after = disk.pack_writes  # the disk is full from now on
        for t in state.values():
            t.add_(1.0)
        pending = ck.save(state)
        with pytest.raises(gpusnap.CheckpointError, match="No space"):
            pending.wait()
        gc.collect()
        assert snapshot_refs and all(r() is None for r in snapshot_refs), "a failed save kept its snapshot"


@pytest.mark.parametrize("incremental", [False, True])
def test_a_finished_save_leaves_no_cyclic_garbage(tmp_path: Any, incremental: bool) -> None:
    """A save's records (one per storage) must be freed by reference counting once it is
    done: left in reference cycles (the window holding the save's bound methods, the save
    holding its copier), every save of GPT-2 large left ~9k objects for Python's full
    collections, which run on the program's thread and grew with them."""
    import gc

    state = {f"t{i}": torch.randn(4096) for i in range(16)}
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config(incremental=incremental), keep_last=2) as ck:
        ck.save(state).wait()
        gc.collect()
        gc.disable()
        try:
            for _ in range(3):
                for t in state.values():
                    t.add_(1.0)
                ck.save(state).wait()
            ck.list()
            found = gc.collect()
        finally:
            gc.enable()
    assert found == 0, f"{found} objects were only freed by the cycle collector"


def test_uncompared_snapshots_go_back_before_the_commit(tmp_path: Any, snapshot_refs: list[Any],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that copies at once hashes its snapshot when its window closes, while the
    writers store, and lets it go then: a whole-state snapshot is as big as the state, and
    used to stay allocated until the commit, seconds later on a big model."""
    import gc

    writers = StoreGate(held=False)
    writers.install(monkeypatch)
    state = {f"t{i}": torch.randn(4096) for i in range(4)}
    config = _config(cpu_snapshot_bytes=1 << 24, staging_bytes=1 << 20)
    with gpusnap.Checkpointer(tmp_path / "ck", config=config) as ck:
        for _ in range(2):  # nothing to compare with; compares (0% unchanged)
            for t in state.values():
                t.add_(1.0)
            ck.save(state).wait()
        snapshot_refs.clear()
        writers.hold()  # the next save's chunk stores wait
        for t in state.values():
            t.add_(1.0)
        expected = {k: v.clone() for k, v in state.items()}
        pending = ck.save(state)
        try:
            # (the hashing ends on another thread: polled, with a deadline only against a hang)
            wait_until(lambda: gc.collect() is not None and snapshot_refs and all(r() is None for r in snapshot_refs),
                       "the snapshot was let go before the commit")
            assert not pending.done()  # the writers are still held: nothing is committed yet
        finally:
            writers.release()
        info = pending.wait()
        assert info.stats["incremental"].startswith("not compared"), info.stats["incremental"]
        got = {k: torch.zeros_like(v) for k, v in state.items()}
        ck.restore(got, info.id)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
