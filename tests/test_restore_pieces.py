"""Restore in pieces: one read per stored run, one copy thread, checks on the device, per-span readiness."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from restore_support import add_device_hashes, corrupt_chunk, held_root, log_ranges, on_demand, tiny_config

import gpusnap
from gpusnap import IntegrityError
from gpusnap.kernels.chunk_hash import hashes_to_hex
from gpusnap.restore import restorer as restorer_mod
from gpusnap.restore.apply_bytes import apply_ranges
from gpusnap.restore.pipeline import copier as copier_mod
from gpusnap.restore.pipeline.device_check import hex_to_hashes
from gpusnap.restore.pipeline.loader import Loader
from gpusnap.restore.pipeline.schedule import Schedule
from gpusnap.restore.pipeline.staging import SlotPool
from gpusnap.state import SpanInfo, plan_restore
from gpusnap.storage.repository import Repository

CS = 512  # tiny_config's chunk size


def _save(root: Path, state: dict, **config: Any) -> str:
    with gpusnap.Checkpointer(root, config=tiny_config(**config)) as ck:
        return ck.save(state, blocking=True).wait().id


def _runs(repo: Repository, digests: tuple[str, ...]) -> int:
    """Runs of chunks stored back to back in one pack, from the pack indexes (the expected reads)."""
    runs, last = 0, None
    for d in digests:
        path, offset, length = repo._locate(d, "")
        if last is None or last != (path, offset):
            runs += 1
        last = (path, offset + length)
    return runs


# -- piece reads ---------------------------------------------------------------------------------
def test_piece_read_is_one_call_per_stored_run(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    g = torch.Generator().manual_seed(0)
    mixed = torch.randn(128 * 300, generator=g)  # 300 chunks over several 64 KiB packs
    mixed[128 * 10 : 128 * 12] = 0  # two zero chunks...
    mixed[128 * 50 : 128 * 51] = 0  # ...and a third: deduplicated, so the runs break there
    source = {"plain": torch.randn(128 * 40, generator=g), "mixed": mixed}
    with held_root(root, monkeypatch) as backend:
        checkpoint = _save(root, source)
        repo = Repository.open(root)
        repo.backend = backend
        manifest = repo.load_manifest(checkpoint)
        for entry, name in zip(manifest.storages, ("plain", "mixed")):
            expected = _runs(repo, entry.chunks)
            out = bytearray(entry.nbytes)
            backend.chunk_reads.clear()
            cost = repo.read_chunks_into(entry.chunks, memoryview(out), CS, what=name)
            assert cost.reads == len(backend.chunk_reads) == expected, name
            assert bytes(out) == source[name].numpy().tobytes()
        plain, mixed_entry = manifest.storages
        assert _runs(repo, plain.chunks) <= 4, "a span is written mostly in order: a few runs, not 40"
        assert 3 < _runs(repo, mixed_entry.chunks) < 20, "dedup and pack ends break the runs, not every chunk"


def test_piece_read_verifies_every_chunk(tmp_path):
    root = tmp_path / "ck"
    source = {"t": torch.arange(128 * 16.0)}
    checkpoint = _save(root, source)
    corrupt_chunk(root, source["t"][128 * 9 : 128 * 10].numpy().tobytes(), 7)
    repo = Repository.open(root)
    entry = repo.load_manifest(checkpoint).storages[0]
    with pytest.raises(IntegrityError, match="does not match its digest"):
        repo.read_chunks_into(entry.chunks, memoryview(bytearray(entry.nbytes)), CS, what="t")
    out = bytearray(entry.nbytes)
    repo.read_chunks_into(entry.chunks, memoryview(out), CS, what="t", verify=False)  # length checks only
    with pytest.raises(IntegrityError, match="expects"):
        repo.read_chunks_into(entry.chunks, memoryview(bytearray(entry.nbytes - 4)), CS)


def test_restore_in_many_chunk_pieces(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    g = torch.Generator().manual_seed(1)
    big = torch.randn(128 * 200, generator=g)
    big[128 * 30 : 128 * 33] = 0  # deduplicated chunks inside a piece
    source = {"big": big, "small": torch.randn(100, generator=g), "t": torch.randn(40, 30, generator=g).t()}
    checkpoint = _save(root, source)
    with gpusnap.Checkpointer(root, config=tiny_config(staging_bytes=64 * 1024)) as ck:
        target = {"big": torch.zeros_like(big), "small": torch.zeros(100), "t": torch.zeros(40, 30).t()}
        handle = ck.restore(target, checkpoint, verify="stream")
        piece_chunks = ck._restorer._slots.slot_bytes // CS
    assert piece_chunks >= 8, "the test needs pieces of many chunks"
    for k, v in source.items():
        assert torch.equal(target[k], v), k
    stats = handle.stats
    assert stats["chunks_read"] == 200 + 1 + 10
    assert stats["pieces"] < stats["chunks_read"] / 4
    assert stats["reads"] < stats["chunks_read"] / 4
    assert stats["verify_path"] == "host" and stats["host_verified_bytes"] == stats["bytes_read"]


def test_hex_to_hashes_inverts_hashes_to_hex():
    g = torch.Generator().manual_seed(2)
    rows = torch.randint(-(2**63), 2**63 - 1, (50, 2), generator=g, dtype=torch.int64)
    rows[0] = torch.tensor([-1, 0])
    rows[1] = torch.tensor([-(2**63), 2**63 - 1])
    assert torch.equal(hex_to_hashes(hashes_to_hex(rows)), rows)
    assert hex_to_hashes([]).shape == (0, 2)
    with pytest.raises(gpusnap.CheckpointError):
        hex_to_hashes(["zz" * 16])
    with pytest.raises(gpusnap.CheckpointError):
        hex_to_hashes(["00" * 15])


# -- verification on the device ------------------------------------------------------------------
def test_device_check_restores_without_host_hashing(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    source = {"big": torch.randn(128 * 64), "t": torch.randn(8, 9).t(), "step": 4}
    checkpoint = _save(root, source)
    add_device_hashes(root, checkpoint)
    monkeypatch.setattr(restorer_mod, "VERIFY_ON_DEVICE", True)  # CPU targets take the device path
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        target = {"big": torch.zeros(128 * 64), "t": torch.zeros(8, 9).t(), "step": 0}
        handle = ck.restore(target, verify="stream")
    assert torch.equal(target["big"], source["big"]) and torch.equal(target["t"], source["t"])
    stats = handle.stats
    assert stats["device_verified_bytes"] == 128 * 64 * 4, "the streamed span was checked on the device"
    assert stats["host_verified_bytes"] == 8 * 9 * 4, "a whole-span target keeps BLAKE2b on the host"
    assert stats["verify_path"] == "mixed"


def test_device_check_mismatch_raises_and_the_corrupt_piece_never_lands(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    source = {"big": torch.arange(128 * 64.0)}  # 64 chunks; #40 is corrupt
    checkpoint = _save(root, source)
    add_device_hashes(root, checkpoint)
    corrupt_chunk(root, source["big"][128 * 40 : 128 * 41].numpy().tobytes(), 9)
    monkeypatch.setattr(restorer_mod, "VERIFY_ON_DEVICE", True)
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        target = {"big": torch.zeros(128 * 64)}
        with pytest.raises(IntegrityError, match="big") as err:
            ck.restore(target, verify="stream")
        piece = ck._restorer._slots.slot_bytes // CS
        assert "device hash" in str(err.value) and "#40" in str(err.value)
        assert "partly written: tensor big" in str(err.value) or "no tensor was written" in str(err.value)
        first = 40 // piece * piece
        assert target["big"][128 * first : 128 * (first + piece)].eq(0).all(), "the corrupt piece never landed"
        # the same corruption is not seen without checking, and BLAKE2b sees it on the host path
        ck.restore(target, verify="off")
        assert not torch.equal(target["big"], source["big"])
        monkeypatch.setattr(restorer_mod, "VERIFY_ON_DEVICE", False)
        with pytest.raises(IntegrityError, match="does not match its digest"):
            ck.restore(target, verify="stream")


# -- per-span readiness --------------------------------------------------------------------------
@pytest.mark.parametrize("on_device", [False, True])
def test_a_span_is_loaded_right_after_its_last_piece(tmp_path, monkeypatch, on_device):
    root = tmp_path / "ck"
    source = {f"t{i}": torch.full((128 * 6,), float(i)) for i in range(5)}  # 6 chunks: 3 pieces of 2
    checkpoint = _save(root, source)
    add_device_hashes(root, checkpoint)
    repo = Repository.open(root)
    manifest = repo.load_manifest(checkpoint)
    target = {k: torch.zeros(128 * 6) for k in source}
    plan = plan_restore(target, manifest.tree, [SpanInfo(e.nbytes, e.device) for e in manifest.storages])
    log: list[tuple[str, int]] = []
    real_loaded = Schedule.mark_loaded_many
    log_ranges(monkeypatch, lambda i: log.append(("copy", i)))
    order = [3, 0, 4, 1, 2]
    loader = Loader(
        repo, manifest, plan, order=order, threads=1, slots=SlotPool(4, 2 * CS, pinned=False), streams={},
        verify=True, verify_on_device=on_device,
    )
    loader.schedule.mark_loaded_many = lambda spans: (  # type: ignore[method-assign]
        log.extend(("loaded", ls.index) for ls, _ in spans), real_loaded(loader.schedule, spans))[1]
    loader.start()
    loader.wait()
    assert log == [e for i in order for e in [("copy", i)] * 3 + [("loaded", i)]]
    assert loader.stats.verify_path() == ("device" if on_device else "host")


def test_lazy_wait_ends_when_the_span_is_copied_not_when_the_load_is(tmp_path, monkeypatch):
    source = {f"t{i}": torch.full((128 * 8,), float(i)) for i in range(8)}
    with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config(io_threads=1)) as ck:
        ck.save(source, blocking=True)
        target = {k: torch.zeros(128 * 8) for k in source}
        on_demand(monkeypatch)  # nothing loads but what the program waits for, until handle.wait()
        handle = ck.restore(target, lazy=True)
        assert target["t0"].sum().item() == 0 * 128 * 8  # waits for t0 alone
        session = ck._restorer._active
        assert session is not None
        states = [ls.state.value for ls in session.loader.schedule.spans]
        assert states[0] == "loaded" and states.count("loaded") == 1, states
        handle.wait()
    for k, v in source.items():
        assert torch.equal(target[k], v)


# -- one thread waits on CUDA ---------------------------------------------------------------------
class _FakeEvent:
    """Stands in for a CUDA event on CPU: records which thread waits on it; completes late."""

    calls: ClassVar[list[tuple[str, str]]] = []
    lock = threading.Lock()

    def __init__(self) -> None:
        self.polls = 0

    def _note(self, what: str) -> None:
        with self.lock:
            self.calls.append((threading.current_thread().name, what))

    def query(self) -> bool:
        self._note("query")
        self.polls += 1
        return self.polls > 2  # not done at first: the copy thread must poll or block

    def synchronize(self) -> None:
        self._note("synchronize")

    def record(self, stream: Any = None) -> None:
        pass


@pytest.mark.parametrize("on_device", [False, True])
def test_only_the_copy_thread_waits_on_events(tmp_path, monkeypatch, on_device):
    root = tmp_path / "ck"
    source = {f"t{i}": torch.randn(128 * 20, generator=torch.Generator().manual_seed(i)) for i in range(6)}
    checkpoint = _save(root, source)
    add_device_hashes(root, checkpoint)
    _FakeEvent.calls = []
    monkeypatch.setattr(copier_mod, "ASYNC_COPY_DEVICES", frozenset({"cuda", "cpu"}))  # CPU copies "asynchronous"
    monkeypatch.setattr(copier_mod, "waitable_event", _FakeEvent)
    monkeypatch.setattr(restorer_mod, "VERIFY_ON_DEVICE", on_device)
    monkeypatch.setattr("gpusnap.restore.restorer.os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    with gpusnap.Checkpointer(root, config=tiny_config(io_threads=4)) as ck:
        target = {k: torch.zeros_like(v) for k, v in source.items()}
        handle = ck.restore(target, verify="stream")
    for k, v in source.items():
        assert torch.equal(target[k], v), k
    assert handle.stats["threads"] >= 4
    waiters = {name for name, _ in _FakeEvent.calls}
    assert waiters == {"gpusnap-restore-copy"}, waiters
    assert any(what == "synchronize" for _, what in _FakeEvent.calls), "regions were recycled after their events"


def test_config_knobs_reach_the_loader(tmp_path):
    """Config.restore_verify_on_device='on' takes the device path on CPU targets; a small
    Config.restore_piece_bytes gives more pieces than the default."""
    root = tmp_path / "ck"
    source = {"big": torch.randn(128 * 64)}
    checkpoint = _save(root, source)
    add_device_hashes(root, checkpoint)
    with gpusnap.Checkpointer(root, config=tiny_config(restore_verify_on_device="on", restore_piece_bytes=4 * CS)) as ck:
        target = {"big": torch.zeros(128 * 64)}
        handle = ck.restore(target, verify="stream")
    assert torch.equal(target["big"], source["big"])
    assert handle.stats["verify_path"] == "device"
    assert handle.stats["pieces"] >= 64 // 4
    with pytest.raises(ValueError, match="restore_verify_on_device"):
        tiny_config(restore_verify_on_device="maybe")


# -- batches of small spans ---------------------------------------------------------------------------
def _small_state() -> dict[str, torch.Tensor]:
    """Many small tensors of odd sizes (a model's biases and norms) and one large one."""
    g = torch.Generator().manual_seed(3)
    state = {f"s{i}": torch.randn(3 + 37 * i, generator=g) for i in range(24)}
    state["bytes"] = torch.randint(0, 256, (1001,), dtype=torch.uint8, generator=g)
    state["big"] = torch.randn(128 * 24, generator=g)
    return state


def test_take_batch_joins_whole_small_spans_of_one_kind() -> None:
    from gpusnap.restore.pipeline.schedule import BATCH_ALIGN, LoadSpan

    cpu = frozenset({torch.device("cpu")})
    spans = [
        LoadSpan(0, 700, 2, True, cpu, device_check=True),
        LoadSpan(1, 100, 1, True, cpu, device_check=True),
        LoadSpan(2, 300, 1, True, cpu, device_check=True),
        LoadSpan(3, 100, 1, True, cpu, device_check=False),  # another kind: passed over
        LoadSpan(4, 5000, 10, True, cpu, device_check=False),
    ]
    schedule = Schedule(spans, range(5), chunk_size=CS, piece_chunks=4)
    batch = schedule.take_batch(room=4 * CS, max_chunks=8)
    assert [(p.span.index, o) for p, o in batch] == [(0, 0), (1, 768), (2, 1024)]
    assert all(o % BATCH_ALIGN == 0 for _, o in batch)
    assert [p.span.index for p, _ in schedule.take_batch(room=4 * CS, max_chunks=8)] == [3]
    big = schedule.take_batch(room=4 * CS, max_chunks=8)  # a large span: pieces, never batched
    assert [(p.span.index, p.first, p.count) for p, _ in big] == [(4, 0, 4)]
    # a span the program waits for goes first, and alone
    spans = [LoadSpan(i, 100, 1, True, cpu) for i in range(4)]
    schedule = Schedule(spans, range(4), chunk_size=CS, piece_chunks=4)
    threading.Thread(target=schedule.wait, args=(spans[2],), daemon=True).start()
    while not schedule._urgent:
        pass
    assert [p.span.index for p, _ in schedule.take_batch(room=4 * CS, max_chunks=8)] == [2]
    assert [p.span.index for p, _ in schedule.take_batch(room=4 * CS, max_chunks=8)] == [0, 1, 3]


def test_take_batch_joins_small_checkable_spans_to_a_device_checked_batch() -> None:
    """A small span that could be checked on the device (``checkable``) joins its checked
    neighbours and is then checked on the device too; alone it keeps the host check."""
    from gpusnap.restore.pipeline.schedule import LoadSpan

    cpu = frozenset({torch.device("cpu")})

    def spans() -> list[LoadSpan]:
        return [
            LoadSpan(0, 100, 1, True, cpu, checkable=True),  # small: host check when alone
            LoadSpan(1, 900, 2, True, cpu, device_check=True, checkable=True),
            LoadSpan(2, 100, 1, True, cpu, checkable=True),
            LoadSpan(3, 100, 1, True, cpu),  # not checkable (no hashes): ends the batch
            LoadSpan(4, 100, 1, True, cpu, checkable=True),
        ]

    joined = spans()
    schedule = Schedule(joined, range(5), chunk_size=CS, piece_chunks=4)
    # span 3 cannot be checked on the device: passed over, it loads next
    assert [p.span.index for p, _ in schedule.take_batch(room=4 * CS, max_chunks=8)] == [0, 1, 2, 4]
    assert [ls.device_check for ls in joined] == [True, True, True, False, True], "the batch is checked on the device"
    assert [p.span.index for p, _ in schedule.take_batch(room=4 * CS, max_chunks=8)] == [3]
    assert schedule.take_batch(room=4 * CS, max_chunks=8) == []
    alone = [LoadSpan(0, 100, 1, True, cpu, checkable=True)]
    schedule = Schedule(alone, range(1), chunk_size=CS, piece_chunks=4)
    assert [p.span.index for p, _ in schedule.take_batch(room=4 * CS, max_chunks=8)] == [0]
    assert not alone[0].device_check, "alone, a small span keeps BLAKE2b on the host"
    smalls = [LoadSpan(i, 100, 1, True, cpu, checkable=True) for i in range(3)]
    schedule = Schedule(smalls, range(3), chunk_size=CS, piece_chunks=4)
    assert [p.span.index for p, _ in schedule.take_batch(room=4 * CS, max_chunks=8)] == [0, 1, 2]
    assert not any(ls.device_check for ls in smalls), "small spans only: BLAKE2b on the host"
    # join_checks=False: the kinds stay apart, as before
    apart = spans()
    schedule = Schedule(apart, range(5), chunk_size=CS, piece_chunks=4, join_checks=False)
    batches = [[p.span.index for p, _ in b] for b in iter(lambda: schedule.take_batch(4 * CS, 8), [])]
    assert batches == [[0, 2, 3, 4], [1]]
    assert [ls.device_check for ls in apart] == [False, True, False, False, False]


def test_take_batch_passes_over_a_few_spans_of_another_kind() -> None:
    """An AdamW state in load order: each parameter's step counter (CPU) between its two
    moments (GPU). The moments batch together, the counters too, and every span loads once."""
    from gpusnap.restore.pipeline import schedule as schedule_mod
    from gpusnap.restore.pipeline.schedule import LoadSpan

    cpu, gpu = frozenset({torch.device("cpu")}), frozenset({torch.device("meta")})
    spans = []
    for p in range(30):
        spans.append(LoadSpan(3 * p, 8, 1, True, cpu))  # step
        spans += [LoadSpan(3 * p + k, 100, 1, True, gpu) for k in (1, 2)]  # exp_avg, exp_avg_sq
    schedule = Schedule(spans, range(len(spans)), chunk_size=CS, piece_chunks=64)
    batches = [[p.span.index for p, _ in b] for b in iter(lambda: schedule.take_batch(64 * CS, 64), [])]
    assert sorted(i for b in batches for i in b) == list(range(90)), "every span exactly once"
    for b in batches:
        assert len({spans[i].devices for i in b}) == 1, "one kind per batch"
    # without passing over: 60 batches (a counter, then a pair of moments, each time)
    assert len(batches) <= 6, batches
    assert len(batches[0]) > schedule_mod.BATCH_SKIP // 2, "the counters' batch went past the moments"


def _interleaved_state() -> dict[str, torch.Tensor]:
    """Weight matrices with small biases between them, in load order (a model's layers)."""
    g = torch.Generator().manual_seed(5)
    state: dict[str, torch.Tensor] = {}
    for layer in range(6):
        state[f"w{layer}"] = torch.randn(128 * 5 + layer, generator=g)  # above the size threshold
        state[f"b{layer}"] = torch.randn(7 + layer, generator=g)  # below it
    return state


def _checkable_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU targets count as device-checkable in "auto" mode, as CUDA ones do on a GPU."""
    from gpusnap.restore.pipeline import loader as loader_mod

    monkeypatch.setattr(loader_mod, "DEVICE_CHECKED", frozenset({"cuda", "cpu"}))


@pytest.mark.parametrize("join", [True, False])
def test_small_spans_between_large_ones_are_checked_on_the_device_in_their_batch(tmp_path, monkeypatch, join):
    from gpusnap.restore.pipeline import loader as loader_mod

    root = tmp_path / "ck"
    source = _interleaved_state()
    checkpoint = _save(root, source)
    add_device_hashes(root, checkpoint)
    _checkable_on_cpu(monkeypatch)
    monkeypatch.setattr(loader_mod, "JOIN_CHECKS", join)
    monkeypatch.setattr(restorer_mod, "reader_threads", lambda io_threads: 1)
    config = tiny_config(io_threads=1, staging_bytes=64 * CS, restore_piece_bytes=16 * CS, device_check_min_bytes=4 * CS)
    with gpusnap.Checkpointer(root, config=config) as ck:
        target = {k: torch.zeros_like(v) for k, v in source.items()}
        handle = ck.restore(target, checkpoint, verify="stream")
    for k, v in source.items():
        assert torch.equal(target[k], v), k
    stats = handle.stats
    small = sum(v.nbytes for k, v in source.items() if k.startswith("b"))
    if join:
        assert stats["verify_path"] == "device" and stats["host_verified_bytes"] == 0
        assert stats["batched_spans"] >= 6, stats
    else:
        assert stats["verify_path"] == "mixed" and stats["host_verified_bytes"] == small


def test_a_corrupt_small_span_in_a_joined_batch_is_caught_on_the_device(tmp_path, monkeypatch):
    """b3's batch is checked after the readers have ended (every scratch slot is resolved at
    the end): this found the copy thread waiting forever for an end it had already taken."""
    root = tmp_path / "ck"
    source = _interleaved_state()
    checkpoint = _save(root, source)
    add_device_hashes(root, checkpoint)
    corrupt_chunk(root, source["b3"].numpy().tobytes(), 3)
    _checkable_on_cpu(monkeypatch)
    monkeypatch.setattr(restorer_mod, "reader_threads", lambda io_threads: 1)
    config = tiny_config(io_threads=1, staging_bytes=64 * CS, restore_piece_bytes=16 * CS, device_check_min_bytes=4 * CS)
    with gpusnap.Checkpointer(root, config=config) as ck:
        target = {k: torch.zeros_like(v) for k, v in source.items()}
        with pytest.raises(IntegrityError, match=r"b3.*does not match its device hash"):
            ck.restore(target, checkpoint, verify="stream")
    assert not target["b3"].any(), "the corrupt span was written"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("on_device", [False, True])
def test_small_spans_travel_in_batches(tmp_path, monkeypatch, on_device, device):
    """One region, one copy and (checked on the device) one hash launch for many small
    tensors; every byte lands where it belongs, and a batch's stats say so."""
    root = tmp_path / "ck"
    source = {k: v.to(device) for k, v in _small_state().items()}
    checkpoint = _save(root, source)
    add_device_hashes(root, checkpoint)
    monkeypatch.setattr(restorer_mod, "VERIFY_ON_DEVICE", on_device)
    # two readers whatever the core count: more would split the staging into regions too
    # small to batch in (20 regions of 3 chunks on the 16-core H200 host)
    monkeypatch.setattr(restorer_mod, "reader_threads", lambda io_threads: io_threads)
    with gpusnap.Checkpointer(root, config=tiny_config(io_threads=2, staging_bytes=64 * CS, restore_piece_bytes=16 * CS)) as ck:
        target = {k: torch.zeros_like(v) for k, v in source.items()}
        handle = ck.restore(target, checkpoint, verify="stream")
    for k, v in source.items():
        assert torch.equal(target[k], v), k
    assert handle.stats["batched_spans"] >= 10
    assert handle.stats["verify_path"] == ("device" if on_device else "host")


def test_a_corrupt_chunk_in_a_batch_is_named_and_never_written(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    source = _small_state()
    checkpoint = _save(root, source)
    add_device_hashes(root, checkpoint)
    victim = source["s9"]
    corrupt_chunk(root, victim.numpy().tobytes()[:64], 5)
    monkeypatch.setattr(restorer_mod, "VERIFY_ON_DEVICE", True)
    with gpusnap.Checkpointer(root, config=tiny_config(io_threads=1, staging_bytes=64 * CS, restore_piece_bytes=16 * CS)) as ck:
        target = {k: torch.zeros_like(v) for k, v in source.items()}
        with pytest.raises(IntegrityError, match=r"s9.*does not match its device hash"):
            ck.restore(target, checkpoint, verify="stream")
    assert not target["s9"].any(), "the corrupt chunk's tensor was written"


def test_a_failed_batch_reports_the_members_it_already_wrote(tmp_path, monkeypatch):
    """Host path: members are applied as they are read; when a later member is corrupt the
    error counts exactly the tensors written (found by review: it used to count none)."""
    import re

    root = tmp_path / "ck"
    source = _small_state()
    checkpoint = _save(root, source)
    corrupt_chunk(root, source["s9"].numpy().tobytes()[:64], 5)
    monkeypatch.setattr(restorer_mod, "VERIFY_ON_DEVICE", False)
    monkeypatch.setattr("gpusnap.restore.restorer.os.sched_getaffinity", lambda pid: {0}, raising=False)
    with gpusnap.Checkpointer(root, config=tiny_config(io_threads=1, staging_bytes=64 * CS, restore_piece_bytes=16 * CS)) as ck:
        target = {k: torch.zeros_like(v) for k, v in source.items()}
        with pytest.raises(IntegrityError) as error:
            ck.restore(target, checkpoint, verify="stream")
    written = [k for k, v in target.items() if v.any()]
    whole = [k for k in written if torch.equal(target[k], source[k])]
    assert whole and "s9" not in written
    found = re.search(r"(\d+) of \d+ storages were restored", str(error.value))
    assert found and int(found.group(1)) == len(whole), str(error.value)
    for k in set(written) - set(whole):  # a span cut off mid-way is named as partly written
        assert f"partly written: tensor {k}" in str(error.value) or f"; tensor {k}" in str(error.value), k


def _plan_of(root: Path, checkpoint: str, target: dict):
    manifest = Repository.open(root).load_manifest(checkpoint)
    return manifest, plan_restore(target, manifest.tree, [SpanInfo(e.nbytes, e.device) for e in manifest.storages])


@pytest.mark.parametrize("fail_batch_call", [False, True])
def test_apply_ranges_writes_every_member_of_a_batch(tmp_path, monkeypatch, fail_batch_call):
    """One call for a batch: plain, Parameter (its version moves, as with copy_) and inference
    targets all get their bytes; if the batched call fails, the one-by-one path still does."""
    source = {"a": torch.arange(10.0), "p": torch.arange(7, dtype=torch.int64), "i": torch.arange(5, dtype=torch.int16)}
    checkpoint = _save(tmp_path / "ck", source)
    with torch.inference_mode():
        frozen = torch.zeros(5, dtype=torch.int16)
    target = {"a": torch.zeros(10), "p": torch.nn.Parameter(torch.zeros(7, dtype=torch.int64), requires_grad=False),
              "i": frozen}
    manifest, plan = _plan_of(tmp_path / "ck", checkpoint, target)
    index = {paths[0]: i for i, paths in plan.span_paths.items() if paths}
    region = torch.zeros(1024, dtype=torch.uint8)
    ranges, at = [], 0
    for key, t in source.items():
        raw = t.view(torch.uint8)
        region[at : at + raw.numel()] = raw
        ranges.append((index[key], 0, at, raw.numel()))
        at += 256  # members at aligned offsets, padding between them
    if fail_batch_call:
        monkeypatch.setattr(gpusnap.restore.apply_bytes, "copy_batch", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no")))
    version = target["p"]._version
    apply_ranges(plan, ranges, region, non_blocking=False)
    for key, t in source.items():
        assert torch.equal(target[key], t), key
    assert target["p"]._version > version
    assert plan.pending_spans == frozenset()


def test_apply_ranges_names_the_tensor_it_could_not_write(tmp_path, monkeypatch):
    source = {"a": torch.arange(4.0), "b": torch.arange(4.0) + 10}
    checkpoint = _save(tmp_path / "ck", source)
    target = {"a": torch.zeros(4), "b": torch.zeros(4)}
    _, plan = _plan_of(tmp_path / "ck", checkpoint, target)
    index = {paths[0]: i for i, paths in plan.span_paths.items() if paths}
    region = torch.cat([source["a"].view(torch.uint8), source["b"].view(torch.uint8)])
    monkeypatch.setattr(gpusnap.restore.apply_bytes, "copy_batch", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no")))
    real = gpusnap.restore.apply_bytes.copy_bytes

    def copy_bytes(dst, src, inference, non_blocking):  # noqa: ANN001 (the second target fails)
        if dst.data_ptr() == target["b"].data_ptr():
            raise RuntimeError("device lost")
        real(dst, src, inference, non_blocking)

    monkeypatch.setattr(gpusnap.restore.apply_bytes, "copy_bytes", copy_bytes)
    with pytest.raises(gpusnap.CheckpointError, match=r"b: copying the restored bytes failed.*device lost"):
        apply_ranges(plan, [(index["a"], 0, 0, 16), (index["b"], 0, 16, 16)], region, non_blocking=False)
    assert torch.equal(target["a"], source["a"])  # written before the failure


def test_a_batch_copy_failure_on_the_copy_thread_counts_what_it_wrote(tmp_path, monkeypatch):
    """Copy-thread path (checked on the device, here CPU tensors): the batched copy fails, the
    one-by-one copy fails at one member; the error counts the members before it as restored,
    names it as partly written, and the members after it keep their old values."""
    import re

    root = tmp_path / "ck"
    source = _small_state()
    checkpoint = _save(root, source)
    add_device_hashes(root, checkpoint)
    monkeypatch.setattr(restorer_mod, "VERIFY_ON_DEVICE", True)
    monkeypatch.setattr(restorer_mod, "reader_threads", lambda io_threads: io_threads)
    monkeypatch.setattr(gpusnap.restore.apply_bytes, "copy_batch", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no")))
    target = {k: torch.zeros_like(v) for k, v in source.items()}
    bad = target["s9"].data_ptr()
    real = gpusnap.restore.apply_bytes.copy_bytes

    def copy_bytes(dst, src, inference, non_blocking):  # noqa: ANN001
        if dst.data_ptr() == bad:
            raise RuntimeError("device lost")
        real(dst, src, inference, non_blocking)

    monkeypatch.setattr(gpusnap.restore.apply_bytes, "copy_bytes", copy_bytes)
    with gpusnap.Checkpointer(root, config=tiny_config(io_threads=1, staging_bytes=64 * CS, restore_piece_bytes=16 * CS)) as ck:
        with pytest.raises(gpusnap.CheckpointError, match="s9: copying the restored bytes failed") as error:
            ck.restore(target, checkpoint, verify="stream")
    message = str(error.value)
    whole = [k for k in target if torch.equal(target[k], source[k]) and source[k].any()]
    assert whole and "s9" not in whole
    found = re.search(r"(\d+) of \d+ storages were restored", message)
    assert found and int(found.group(1)) == len(whole), message
    assert "partly written: tensor s9" in message, message
    untouched = [k for k in target if not target[k].any()]
    assert untouched and all(f"tensor {k}" not in message.split("partly written:")[1] for k in untouched if k != "s9")
