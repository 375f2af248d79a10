"""Piece-level capture: the staging arena, partial shadows of in-flight spans, the captured
moment before durability, and the window trace."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported lazily by the tracker's first op otherwise)
from capture_support import StoreGate
from faults import HANG_S

import gpusnap
from gpusnap.capture.staging import StagingArena
from gpusnap.capture.window import CaptureWindow

CHUNK = 512


# -- the arena -----------------------------------------------------------------------------------
def test_arena_reuses_space_released_out_of_order() -> None:
    arena = StagingArena(4096, pinned=False, slab_bytes=4096)
    a, b, c = arena.allocate(1024), arena.allocate(1024), arena.allocate(2048)
    assert (a.start, b.start, c.start) == (0, 1024, 2048)
    assert arena.nbytes == 4096
    arena.release(b)  # b is free but a, older, is not: no space comes back yet
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(arena.allocate(1024)))
    t.start()
    t.join(0.2)
    assert t.is_alive(), "allocate must block while the only free bytes sit behind a live region"
    arena.release(a)  # now [0, 2048) is free
    t.join(HANG_S)
    assert got and got[0].start == 0 and got[0].data.numel() == 1024
    arena.release(c)
    arena.release(got[0])
    assert arena.in_use() == 0


def test_arena_grows_by_slabs_up_to_capacity() -> None:
    arena = StagingArena(3000, pinned=False, slab_bytes=1000)
    regions = [arena.allocate(1000) for _ in range(3)]
    assert arena.nbytes == 3000 and len({id(r.slab) for r in regions}) == 3
    with pytest.raises(ValueError, match="cannot stage"):
        arena.allocate(1001)
    done = threading.Event()
    t = threading.Thread(target=lambda: (arena.allocate(500), done.set()))
    t.start()
    assert not done.wait(0.2), "at capacity: allocate must wait for a release"
    arena.release(regions[1])
    assert done.wait(HANG_S)
    assert arena.nbytes == 3000  # reused, not grown


def test_arena_regions_are_disjoint_under_random_use() -> None:
    import random

    rng = random.Random(7)
    arena = StagingArena(8192, pinned=False, slab_bytes=4096)
    live: list[Any] = []
    for _ in range(2000):
        if live and rng.random() < 0.5:
            arena.release(live.pop(rng.randrange(len(live))))
            continue
        r = arena.try_allocate(rng.choice([1, 100, 512, 1500, 4096]))
        if r is None:
            continue
        for other in live:
            if other.slab is r.slab:
                assert r.end <= other.start or other.end <= r.start, "overlapping staging regions"
        live.append(r)
    assert arena.nbytes == 8192


# -- piece-level protection ------------------------------------------------------------------
def _config(**kw: Any) -> gpusnap.Config:
    base: dict[str, Any] = dict(chunk_size=CHUNK, staging_bytes=4 * CHUNK, pack_size=1 << 16,
                                io_threads=2, eager_cpu_bytes=0, cpu_snapshot_bytes=0, fsync=False)
    base.update(kw)
    return gpusnap.Config(**base)




def test_write_to_a_span_in_flight_shadows_only_the_rest(tmp_path: Any, gate) -> None:
    state = {"a": torch.randn(2048)}  # 8 KiB = 16 chunks; the arena holds 4
    before = state["a"].clone()
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config(cow_budget_bytes=1 << 20)) as ck:
        pending = ck.save(state)
        # a writer holds the first piece (4 chunks, the whole arena): the copier waits for room
        assert gate.entered.wait(HANG_S)
        state["a"].mul_(-3)  # must shadow the 12 chunks not yet copied, and only those
        gate.release()
        info = pending.wait()
        ck.restore(state, info.id)
    assert torch.equal(state["a"], before)
    assert info.stats["bytes_cow"] == 8192 - 4 * CHUNK
    assert info.stats["cow_events"] == 1 and info.stats["waits"] == 0


def test_in_flight_over_budget_waits_for_the_whole_span(tmp_path: Any, gate) -> None:
    state = {"a": torch.randn(2048)}
    before = state["a"].clone()
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config(cow_budget_bytes=CHUNK)) as ck:
        pending = ck.save(state)
        assert gate.entered.wait(HANG_S)  # 4 chunks copied, then the arena is full
        state["a"].fill_(1)  # 12 chunks left > budget: the write waits until all are copied
        info = pending.wait()
        ck.restore(state, info.id)
    assert torch.equal(state["a"], before)
    assert info.stats["bytes_cow"] == 0 and info.stats["waits"] == 1, info.stats


def test_staged_comes_before_durable(tmp_path: Any, gate) -> None:
    state = {"a": torch.randn(256), "b": torch.randn(256)}
    before = {k: v.clone() for k, v in state.items()}
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config(staging_bytes=1 << 20)) as ck:
        pending = ck.save(state)
        pending.wait_staged(HANG_S)  # every byte copied into staging; stores are still held
        assert not pending.done()
        for t in state.values():
            t.zero_()  # free to mutate: no tracker interference needed any more
        gate.release()
        info = pending.wait()
        ck.restore(state, info.id)
    for k in state:
        assert torch.equal(state[k], before[k])


def test_trace_records_the_window(tmp_path: Any) -> None:
    state = {"a": torch.randn(4096), "b": torch.randn(100)}
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config(trace_dir=str(tmp_path / "tr"))) as ck:
        pending = ck.save(state)
        state["b"].add_(1)
        info = pending.wait()
    path = info.stats["trace_path"]
    assert path.endswith(f"{info.id}.trace.json")
    with open(path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    tracks = {e["args"]["name"]: e["tid"] for e in events if e.get("name") == "thread_name"}
    copies = [e for e in events if e.get("tid") == tracks["copy"] and e["ph"] == "X"]
    stores = [e for e in events if e.get("tid") == tracks["store"] and e["ph"] == "X"]
    piece = _config().piece_bytes()  # pieces of whole chunks, as many as the arena holds
    assert sum(1 for e in copies if e["name"].startswith("a ")) == -(-4096 * 4 // piece)
    assert len(stores) == -(-4096 * 4 // piece) + -(-100 * 4 // piece)
    assert all(e["dur"] >= 0 for e in copies)


def test_trace_dir_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSNAP_TRACE_DIR", "/tmp/somewhere")
    monkeypatch.setenv("GPUSNAP_STAGING_BYTES", "0")
    cfg = gpusnap.Config.from_env()
    assert cfg.trace_dir == "/tmp/somewhere"
    assert cfg.staging_capacity() >= cfg.copy_piece_bytes
    assert cfg.piece_bytes() % cfg.chunk_size == 0


def test_opaque_launch_in_a_window_protects_every_buffer(
    tmp_path: Any, gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launch the tracker cannot see (here a stand-in for Triton's JITFunction.run, whose
    module the program imports only after save()) is hooked and makes every pending buffer safe."""
    import sys
    import types

    from torch.utils._mode_utils import no_dispatch

    class JITFunction:
        def run(self, t: torch.Tensor) -> None:
            with no_dispatch():  # a kernel the dispatcher never sees
                t.fill_(-5.0)

    fake = types.ModuleType("triton.runtime.jit")
    fake.JITFunction = JITFunction  # type: ignore[attr-defined]
    state = {"a": torch.randn(2048), "z": torch.randn(1024)}
    before = {k: v.clone() for k, v in state.items()}
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config(cow_budget_bytes=1 << 20, validate=False)) as ck:
        pending = ck.save(state)
        monkeypatch.setitem(sys.modules, "triton.runtime.jit", fake)
        from gpusnap import launch_hooks

        launch_hooks.install_hooks()  # what the import watcher does when a real import finishes
        JITFunction().run(state["z"])
        gate.release()
        info = pending.wait()
        ck.restore(state, info.id)
    assert info.stats["opaque_launches"] == 1
    for k in state:
        assert torch.equal(state[k], before[k]), k


class FakeGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` on CPU: the hooks wrap it like the real class."""

    fail = False
    seen: list[Any] = []

    def capture_begin(self) -> None:
        from gpusnap import launch_hooks

        FakeGraph.seen.append(("begin", launch_hooks.capturing()))
        if FakeGraph.fail:
            raise RuntimeError("capture refused")

    def capture_end(self) -> None:
        FakeGraph.seen.append("end")

    def replay(self) -> None:
        FakeGraph.seen.append("replay")


def test_graph_capture_silences_launches_on_its_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between capture_begin and capture_end nothing runs (it is recorded): the capturing
    thread's launches are not reported; other threads' are; ``on_capture`` runs first."""
    from gpusnap import launch_hooks

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(FakeGraph, "seen", [])
    seen = FakeGraph.seen
    listener = lambda: seen.append("listener")  # noqa: E731
    launch_hooks.add_listener(listener, on_capture=lambda: seen.append(("on_capture", launch_hooks.capturing())))
    try:
        g = torch.cuda.CUDAGraph()
        g.capture_begin()
        assert launch_hooks.capturing()
        launch_hooks._before_launch()  # recorded into the graph: not a launch
        other = threading.Thread(target=launch_hooks._before_launch)
        other.start()
        other.join()
        g.capture_end()
        assert not launch_hooks.capturing()
        g.replay()
        assert seen == [("on_capture", False), ("begin", True), "listener", "end", "listener", "replay"]
        monkeypatch.setattr(FakeGraph, "fail", True)
        with pytest.raises(RuntimeError, match="capture refused"):
            g.capture_begin()
        assert not launch_hooks.capturing(), "a capture that failed to begin leaves the thread unmarked"
    finally:
        launch_hooks.remove_listener(listener)
    assert not launch_hooks._on_capture, "removing a listener drops its on_capture"


def test_ops_recorded_into_a_graph_capture_are_not_tracked(
    tmp_path: Any, gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device op inside a capture runs only at a replay (an opaque launch): the tracker must
    not protect it now (a copy-on-write would be recorded into the program's graph). A write
    to a host tensor runs at once, capture or not, and is tracked. Here meta tensors stand in
    for device tensors."""
    from gpusnap import launch_hooks

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(FakeGraph, "seen", [])
    touched: list[str] = []
    touch = CaptureWindow.touch

    def spy(self: Any, tensors: Any, written: Any, op: str) -> None:
        touched.append(op)
        touch(self, tensors, written, op)

    monkeypatch.setattr(CaptureWindow, "touch", spy)
    state = {"a": torch.randn(4096), "b": torch.randn(4096)}
    before = {k: v.clone() for k, v in state.items()}
    device_like = torch.empty(16, device="meta")
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config(cow_budget_bytes=1 << 20)) as ck:
        pending = ck.save(state)  # a tracked window: its listener installs the hooks
        g = torch.cuda.CUDAGraph()
        g.capture_begin()
        device_like.mul_(2.0)  # recorded, not run
        launch_hooks._before_launch()
        assert touched == [], "a device op inside the capture is not tracked"
        state["a"].mul_(1.0)  # a host write runs now: tracked (value kept: mul by 1)
        assert any(op.startswith("mul_") for op in touched)
        g.capture_end()
        gate.release()
        info = pending.wait()
        ck.restore(state, info.id)
    assert info.stats["opaque_launches"] == 0
    for k in state:
        assert torch.equal(state[k], before[k]), k


class _DoneEvent:
    """A copy event that has completed (the copier's ``_drain`` waits on it)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _bare_copier(arena: StagingArena, piece_bytes: int, in_flight: list[tuple[Any, int]]) -> Any:
    """A Copier with only what ``_drain`` and ``_allocate`` use, and 1024-byte pieces in flight
    (``(event, start)`` each, in order), each holding a region of ``arena``."""
    from collections import deque

    from gpusnap.capture.copier import Copier

    copier = Copier.__new__(Copier)
    copier.arena, copier.trace, copier.piece_bytes = arena, None, piece_bytes
    copier._inflight = deque()
    copier._inflight_bytes = 0
    copier.wait_s = 0.0
    _put_in_flight(copier, in_flight)
    return copier


def _put_in_flight(copier: Any, in_flight: list[tuple[Any, int]]) -> None:
    for event, start in in_flight:
        copier._inflight.append((event, 0.0, [(None, start, 1024, 0)], copier.arena.allocate(1024), 1024))
        copier._inflight_bytes += 1024


def test_copier_drains_its_own_pieces_when_the_arena_is_full() -> None:
    """Pieces in flight hold staging regions until the copier itself drains them: with an
    arena smaller than ``ahead`` pieces, allocating the next piece must drain the oldest one
    instead of waiting for a release that only the copier could cause (a hang on the H200)."""
    arena = StagingArena(2048, pinned=False, slab_bytes=2048)
    stored: list[int] = []
    copier = _bare_copier(arena, 1 << 20, [(_DoneEvent(), 0), (_DoneEvent(), 1024)])  # a full arena
    copier.sink = lambda pieces: [(stored.append(segs[0][1]), arena.release(r)) for segs, r in pieces]
    done = threading.Event()
    result: list[Any] = []
    worker = threading.Thread(target=lambda: (result.append(copier._allocate(1024)), done.set()), daemon=True)
    worker.start()
    assert done.wait(HANG_S), "the copier waited for a region that only it could release"
    assert stored == [0, 1024], "the oldest piece, then every one already done, in order"
    assert not copier._inflight and copier._inflight_bytes == 0
    assert result[0].end - result[0].start == 1024


def test_own_kernel_launches_are_not_opaque_program_launches() -> None:
    """gpusnap's hash kernels run inside ``launch_hooks.internal()``: a listener (a capture
    window protecting every buffer, a lazy restore waiting for everything) is not told; the
    program's launches, on any thread, still are."""
    from gpusnap import launch_hooks

    calls: list[str] = []
    listener = lambda: calls.append(threading.current_thread().name)  # noqa: E731
    launch_hooks.add_listener(listener)
    try:
        with launch_hooks.internal():
            with launch_hooks.internal():
                launch_hooks._before_launch()
            launch_hooks._before_launch()
            other = threading.Thread(target=launch_hooks._before_launch, name="program")
            other.start()
            other.join()
        assert calls == ["program"], "only the other thread's launch is the program's"
        launch_hooks._before_launch()
        assert calls == ["program", threading.current_thread().name]
    finally:
        launch_hooks.remove_listener(listener)


class _PendingEvent(_DoneEvent):
    def query(self) -> bool:
        return False


def test_copier_takes_finished_pieces_in_one_batch_and_stops_at_a_pending_one() -> None:
    arena = StagingArena(4096, pinned=False, slab_bytes=4096)
    batches: list[list[int]] = []
    events = [(_DoneEvent(), 0), (_DoneEvent(), 1024), (_PendingEvent(), 2048), (_DoneEvent(), 3072)]
    copier = _bare_copier(arena, 1 << 20, events)
    copier.sink = lambda pieces: batches.append([segs[0][1] for segs, _r in pieces])
    copier._drain(4096)  # under the limit: no waiting, only what has completed, in order
    assert batches == [[0, 1024]] and copier._inflight_bytes == 2048
    copier._drain(1024)  # over the limit: waits for the pending piece, then takes the done one
    assert batches == [[0, 1024], [2048, 3072]] and not copier._inflight


@pytest.mark.parametrize("seed", range(6))
def test_snapshot_pieces_span_neighbouring_tensors_and_skip_unchanged_chunks(tmp_path: Any, seed: int) -> None:
    """All spans snapshotted: a piece covers runs of changed chunks of neighbouring tensors
    (one copy for many small tensors), cut at skipped chunks and at the piece size; every
    save restores exactly, whatever changed, through a tiny staging arena."""
    import random

    rng = random.Random(seed)
    cfg = gpusnap.Config(chunk_size=CHUNK, copy_piece_bytes=4 * CHUNK, staging_bytes=8 * CHUNK,
                         pack_size=1 << 16, io_threads=2, eager_cpu_bytes=1 << 30, fsync=False)
    state = {f"t{i}": torch.randn(rng.choice([1, 7, 128, 200, 1000, 1500])) for i in range(24)}
    with gpusnap.Checkpointer(tmp_path / "ck", config=cfg, keep_last=2) as ck:
        first = ck.save(state).wait()
        one_per_span = sum(-(-t.numel() * 4 // (4 * CHUNK)) for t in state.values())
        assert first.stats["copies"] < one_per_span, "neighbouring small tensors share copies"
        for _ in range(4):
            for name in rng.sample(sorted(state), rng.randrange(0, 8)):
                t = state[name]
                t[rng.randrange(t.numel())] += 1.0
            expected = {k: v.clone() for k, v in state.items()}
            pending = ck.save(state)
            for t in state.values():  # unseen writes right after save(): must not count
                t.numpy()[:] = -1.0
            info = pending.wait()
            assert not info.stats["tracked"]
            fresh = {k: torch.empty_like(v) for k, v in state.items()}
            ck.restore(fresh, info.id)
            for k in state:
                assert torch.equal(fresh[k], expected[k]), k
            state = {k: v.clone() for k, v in expected.items()}


def test_copier_cuts_drained_batches_at_a_piece_and_returns_regions_the_sink_refuses() -> None:
    """The final drain spreads over writer tasks (a batch is about one piece's bytes); if the
    sink cannot take a batch (its pool is gone), the regions go back to the arena."""
    arena = StagingArena(4096, pinned=False, slab_bytes=4096)
    batches: list[list[int]] = []
    copier = _bare_copier(arena, 2048, [])

    def fill() -> None:
        _put_in_flight(copier, [(_DoneEvent(), start) for start in range(0, 4096, 1024)])

    def take(pieces: Any) -> None:
        batches.append([segs[0][1] for segs, _r in pieces])
        for _segs, region in pieces:
            arena.release(region)

    copier.sink = take
    fill()
    copier._drain(0)
    assert batches == [[0, 1024], [2048, 3072]]

    def refuse(pieces: Any) -> None:
        raise RuntimeError("cannot schedule new futures after shutdown")

    copier.sink = refuse
    fill()
    with pytest.raises(RuntimeError):
        copier._drain(0)
    assert arena.try_allocate(2048) is not None, "a refused batch's regions come back"


def test_a_failed_snapshot_save_does_not_keep_the_snapshot_alive(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The error of a failed save is kept (PendingSave, window.error); the copier clears its
    traceback's frames, so their locals (views of the snapshot buffer: on CUDA, device memory
    the size of the state) are not kept with it."""
    cfg = gpusnap.Config(chunk_size=CHUNK, staging_bytes=8 * CHUNK, copy_piece_bytes=2 * CHUNK,
                         pack_size=1 << 16, io_threads=1, eager_cpu_bytes=1 << 30, fsync=False)
    app = {f"t{i}": torch.randint(0, 255, (3000,), dtype=torch.uint8) for i in range(20)}
    disk = StoreGate(held=False)
    disk.fail_stores_after = 2  # a pack's header and first chunk fit, then the disk is full
    disk.install(monkeypatch)
    with gpusnap.Checkpointer(tmp_path / "ck", config=cfg) as ck:
        pending = ck.save(app)
        with pytest.raises(gpusnap.CheckpointError) as failed:
            pending.wait()
        errors, seen = [failed.value], set()
        while errors:
            err = errors.pop()
            if err is None or id(err) in seen:
                continue
            seen.add(id(err))
            errors += [err.__cause__, err.__context__]
            tb = err.__traceback__
            while tb is not None:
                held = [k for k, v in tb.tb_frame.f_locals.items() if isinstance(v, torch.Tensor)
                        or (isinstance(v, list) and v and isinstance(v[0], tuple) and any(isinstance(x, torch.Tensor) for x in v[0]))]
                assert tb.tb_frame.f_code.co_name != "_copy_snapshots" or not held, held
                tb = tb.tb_next
