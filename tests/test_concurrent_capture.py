"""The concurrent path: save() returns while the program runs, and the checkpoint still
equals the state at the consistent point (DESIGN.md invariants 1, 3, 4, 5)."""

from __future__ import annotations


import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import gpusnap
from gpusnap.save import saves as saves_mod
from gpusnap import Config


def _cfg(**kw) -> Config:
    # the tracked path on every device: no whole-state snapshot, no small-span snapshots
    base = dict(chunk_size=512, staging_bytes=2048, pack_size=1 << 16, io_threads=2, eager_cpu_bytes=0, cpu_snapshot_bytes=0,
                eager_device_bytes=0, device_snapshot=False)
    base.update(kw)
    return Config(**base)




def _restore_into(ck: gpusnap.Checkpointer, like: dict, cid: str) -> dict:
    fresh = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else None for k, v in like.items()}
    ck.restore(fresh, cid)
    return fresh


def test_write_right_after_save_is_shadowed(tmp_path, device, gate):
    big = torch.randn(1 << 20, device=device)  # copied first: many tiny chunks, slow
    last = torch.randn(4096, device=device)
    app = {"big": big, "last": last}
    expected = {k: v.clone() for k, v in app.items()}
    with gpusnap.Checkpointer(tmp_path / "ck", config=_cfg(cow_budget_bytes=1 << 30)) as ck:
        pending = ck.save(app)
        last.mul_(3)  # the copier is still busy with "big": this must be shadowed
        big.add_(1)
        gate.release()
        info = pending.wait()
        assert info.stats["bytes_cow"] >= last.numel() * 4
        assert info.stats["cow_events"] >= 1
        got = _restore_into(ck, app, info.id)
    for k in app:
        assert torch.equal(got[k], expected[k]), k


def test_over_budget_write_waits_for_the_copy(tmp_path, device, gate):
    big = torch.randn(1 << 19, device=device)
    last = torch.randn(4096, device=device)
    app = {"big": big, "last": last}
    expected = {k: v.clone() for k, v in app.items()}
    with gpusnap.Checkpointer(tmp_path / "ck", config=_cfg(cow_budget_bytes=1)) as ck:
        pending = ck.save(app)
        last.fill_(-1)  # no budget: waits until "last" is copied (moved to the queue's head)
        info = pending.wait()
        assert info.stats["bytes_cow"] == 0
        assert info.stats["waits"] >= 1
        got = _restore_into(ck, app, info.id)
    for k in app:
        assert torch.equal(got[k], expected[k]), k
    assert torch.equal(last, torch.full_like(last, -1))


def test_tracker_is_removed_after_the_window(tmp_path):
    t = torch.randn(10_000)
    with gpusnap.Checkpointer(tmp_path / "ck", config=_cfg()) as ck:
        pending = ck.save({"t": t})
        assert len(_get_current_dispatch_mode_stack()) == 1
        pending.wait()
        assert _get_current_dispatch_mode_stack() == []
        ck.save({"t": t}, blocking=True)
        assert _get_current_dispatch_mode_stack() == []


def test_freed_tensor_during_window_is_captured_from_its_storage(tmp_path):
    app = {"a": torch.randn(1 << 18), "b": torch.randn(1 << 12)}
    expected_b = app["b"].clone()
    with gpusnap.Checkpointer(tmp_path / "ck", config=_cfg(cow_budget_bytes=1)) as ck:
        pending = ck.save(app)
        app["b"] = None  # the program drops its tensor; gpusnap holds the storage
        junk = [torch.full((1 << 12,), 7.0) for _ in range(8)]  # allocator reuse pressure
        info = pending.wait()
        del junk
        got = {"a": torch.empty(1 << 18), "b": torch.empty(1 << 12)}
        ck.restore(got, info.id)
    assert torch.equal(got["b"], expected_b)


def test_copy_order_learns_from_previous_window(tmp_path, gate):
    app = {"first": torch.randn(1 << 16), "written": torch.randn(1 << 10)}
    with gpusnap.Checkpointer(tmp_path / "ck", config=_cfg(cow_budget_bytes=1 << 30)) as ck:
        pending = ck.save(app)
        app["written"].add_(1)  # inside the window: the copier is held in "first"
        gate.release()
        pending.wait()
        assert ck._saves.planner.history.write_order[:1] == ["written"]
        flat_order = ck._saves.planner.history.copy_order(gpusnap.state.flatten(app))
        assert flat_order[0] == 1, "the span written soonest is copied first next time"


@pytest.mark.cuda
def test_cuda_graph_replay_in_window_is_treated_as_writing_everything(tmp_path, gate):
    x = torch.zeros(1 << 16, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(0)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        x.add_(1)
    x.zero_()
    app = {"big": torch.randn(1 << 20, device="cuda"), "x": x}
    expected = {k: v.clone() for k, v in app.items()}
    with gpusnap.Checkpointer(tmp_path / "ck", config=_cfg(cow_budget_bytes=1 << 30)) as ck:
        pending = ck.save(app)
        g.replay()  # the dispatcher sees nothing: the hook must protect x
        gate.release()
        info = pending.wait()
        assert info.stats["opaque_launches"] >= 1
        got = _restore_into(ck, app, info.id)
    for k in app:
        assert torch.equal(got[k], expected[k]), k


def test_whole_state_snapshot_runs_untracked_and_stays_exact(tmp_path, device):
    """When every span is snapshotted at save() (all device state within the copy-on-write
    budget; on CPU, spans within eager_cpu_bytes), later windows push no tracker and hash
    nothing for validation; writes the dispatcher never sees (a numpy view) right after
    save() cannot reach the checkpoint; incremental saves still skip unchanged chunks."""
    cfg = Config(chunk_size=512, pack_size=1 << 16, io_threads=2, eager_cpu_bytes=1 << 30)
    state = {"a": torch.randn(4096, device=device), "b": torch.randn(2048, device=device), "step": 3}
    with gpusnap.Checkpointer(tmp_path / "ck", config=cfg) as ck:
        first = ck.save(state).wait()  # the first window logs the program's reads: tracked
        assert first.stats["tracked"]
        for _ in range(3):
            expected = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
            pending = ck.save(state)
            assert not any(type(m).__name__ == "TrackerMode" for m in _get_current_dispatch_mode_stack())
            if device.type == "cpu":
                state["a"].numpy()[:100] = -7.0  # unseen by any dispatcher
            else:
                state["a"].mul_(-7.0)
            info = pending.wait()
            assert not info.stats["tracked"] and info.stats["bytes_snapshot"] == (4096 + 2048) * 4
            assert "nothing to validate" in info.stats["validation"]
            assert info.stats["bytes_skipped"] >= 2048 * 4, "b never changed: its chunks are reused"
            got = _restore_into(ck, state, info.id)
            assert got["step"] == 3
            for k, v in expected.items():
                assert torch.equal(got[k], v), k


@pytest.mark.cuda
def test_whole_state_snapshot_out_of_memory_falls_back_to_tracking(tmp_path, monkeypatch):
    """If the whole-state snapshot finds no device memory after all, the window tracks the
    program instead: the save still equals the state at save()."""
    from gpusnap.capture import window as window_mod

    real = window_mod._batched_copies
    failed = []

    def oom_once(spans, **kwargs):
        if not failed and len(spans) > 1:
            failed.append(len(spans))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return real(spans, **kwargs)

    state = {"a": torch.randn(1 << 20, device="cuda"), "b": torch.randn(1 << 20, device="cuda")}
    cfg = Config(chunk_size=1 << 16, pack_size=1 << 24, io_threads=2, fsync=False, eager_device_bytes=0)
    with gpusnap.Checkpointer(tmp_path / "ck", config=cfg) as ck:
        ck.save(state).wait()
        # private: a CUDA out-of-memory in the window's one batched copy has no public seam
        monkeypatch.setattr(window_mod, "_batched_copies", oom_once)
        expected = {k: v.clone() for k, v in state.items()}
        pending = ck.save(state)
        state["a"].mul_(2)
        info = pending.wait()
        assert failed and info.stats["tracked"] and info.stats["bytes_snapshot"] == 0
        got = _restore_into(ck, state, info.id)
    for k in state:
        assert torch.equal(got[k], expected[k]), k


def test_save_returns_while_a_retention_gc_holds_the_root(tmp_path):
    """The write transaction (the root's shared lock) is opened by the writers: a gc holding
    the root exclusively delays durability, never save() (measured: ~200 ms on the H200)."""
    from gpusnap.storage.repository import Repository

    state = {"w": torch.randn(4096)}
    before = state["w"].clone()
    with gpusnap.Checkpointer(tmp_path / "ck", config=_cfg()) as ck:
        ck.save(state).wait()  # the root exists
        held = Repository.open(tmp_path / "ck").backend.lock(exclusive=True, timeout=0)
        try:
            pending = ck.save(state)  # would wait here for the lock (60 s, then fail)
            state["w"].add_(1)
            assert not pending.done(), "nothing can be durable while the root is held"
        finally:
            held.release()
        info = pending.wait()
        ck.restore(state, info.id)
    assert torch.equal(state["w"], before)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_blocking_save_of_device_state_goes_through_a_window_and_returns_durable(tmp_path, monkeypatch, device):
    """Device state: a blocking save is a concurrent save the caller waits for (pinned
    staging, writers free of the caller's GIL use); host state keeps the stop-the-world path.
    On CPU the choice is forced, to exercise the wiring."""
    if device == "cpu":  # private: only device state takes this path, and CI has no device
        monkeypatch.setattr(saves_mod, "_blocking_via_window", lambda flat: True)
    state = {"w": torch.randn(4096, device=device), "b": torch.randn(100, device=device)}
    before = {k: v.clone() for k, v in state.items()}
    with gpusnap.Checkpointer(tmp_path / "ck", config=_cfg(device_snapshot=True)) as ck:
        pending = ck.save(state, blocking=True)
        assert pending.done(), "a blocking save returns durable"
        for v in state.values():
            v.add_(1)
        info = pending.wait()
        assert "copies" in info.stats, "it went through a capture window"
        assert info.stats["stall_s"] == info.stats["duration_s"], "the caller waited for all of it"
        ck.restore(state, info.id)
    for k in state:
        assert torch.equal(state[k], before[k]), k


def test_blocking_save_of_host_state_stays_stop_the_world(tmp_path):
    state = {"w": torch.randn(4096)}
    with gpusnap.Checkpointer(tmp_path / "ck", config=_cfg()) as ck:
        info = ck.save(state, blocking=True).wait()
    assert info.stats["validation"] == "not needed: stop-the-world capture"


def test_a_copier_that_cannot_start_leaves_no_window_behind(tmp_path, monkeypatch):
    """save() raises, and no tracker or listener is left to hold the program's writes."""
    from gpusnap.capture.copier import Copier

    state = {"w": torch.zeros(1000)}
    with gpusnap.Checkpointer(tmp_path / "ck", config=_cfg(cow_budget_bytes=1)) as ck:
        ck.save(state).wait()
        real_start = Copier.start

        def refuse(self):
            raise RuntimeError("no thread for the copier")

        monkeypatch.setattr(Copier, "start", refuse)
        with pytest.raises(RuntimeError, match="no thread for the copier"):
            ck.save(state)
        assert not _get_current_dispatch_mode_stack()
        state["w"].add_(1)  # would wait forever on a window nobody copies
        monkeypatch.setattr(Copier, "start", real_start)
        info = ck.save(state).wait()
        state["w"].zero_()
        ck.restore(state, info.id)
    assert torch.equal(state["w"], torch.ones(1000))


def test_a_shut_down_copier_runner_falls_back_to_a_thread(tmp_path):
    state = {"w": torch.randn(1000)}
    before = state["w"].clone()
    with gpusnap.Checkpointer(tmp_path / "ck", config=_cfg()) as ck:
        ck.save(state).wait()
        ck._saves.copier_runner.shutdown()  # what interpreter exit does to a save from a late thread
        pending = ck.save(state)
        state["w"].add_(1)
        info = pending.wait()
        ck.restore(state, info.id)
    assert torch.equal(state["w"], before)


@pytest.mark.parametrize("tracked", [False, True])
def test_save_inside_inference_mode_restores_exactly(tmp_path, tracked):
    """A serving loop saves inside torch.inference_mode(): the window's own tensors (hash
    tables, snapshots, staging) must still be writable by gpusnap's threads."""
    with torch.inference_mode():
        state = {"w": torch.randn(1000), "kv": torch.zeros(4096), "rng": gpusnap.RNGState()}
    config = _cfg() if tracked else _cfg(cpu_snapshot_bytes=1 << 30)
    with gpusnap.Checkpointer(tmp_path / "ck", config=config) as ck:
        with torch.inference_mode():
            state["kv"][:10] = 1.0
            expected = state["kv"].clone()
            pending = ck.save(state)
            state["kv"][:20] = 5.0  # right after save(), inside the same block: tracked or snapshotted
            info = pending.wait()
        ck.restore(state, info.id)
    assert torch.equal(state["kv"], expected)
    assert info.stats["bytes_snapshot"] == (0 if tracked else info.stats["bytes_total"])


def test_a_window_that_outlives_its_inference_mode_block_is_never_committed_wrong(tmp_path):
    """Leaving an inference_mode block restores the dispatch keys it found, dropping the one
    the tracker's mode added inside it (PyTorch): later writes are unseen. Validation catches
    them; the retry captures the offender at save()."""
    with torch.inference_mode():
        state = {"kv": torch.zeros(4096)}
    with gpusnap.Checkpointer(tmp_path / "ck", config=_cfg(validate=True)) as ck:
        with torch.inference_mode():
            state["kv"][:10] = 1.0
            expected = state["kv"].clone()
            pending = ck.save(state)
        with torch.inference_mode():
            state["kv"].add_(7.0)  # unseen by the tracker now
        info = pending.wait()
        ck.restore(state, info.id)
    assert torch.equal(state["kv"], expected) or torch.equal(state["kv"], expected + 7.0), (
        "either the consistent point, or (after the retry) the state at the retry's save()"
    )
    if not torch.equal(state["kv"], expected):
        assert "retry" in info.stats["validation"]
