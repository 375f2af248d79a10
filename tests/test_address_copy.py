"""The copier's by-address copies (``capture/address_copy.py``).

On the CPU a fast-tier save copies its snapshot with ``memmove`` by address; the bytes it
restores are the same as through torch. The driver engine's event bookkeeping runs against a
fake driver (no device): an event's handle is recorded again only once that event has
completed, a completed event never reads a later recording's state, and ``close`` destroys
every event made. The real driver path runs in the ``cuda`` test.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

import gpusnap
from gpusnap.capture import address_copy
from gpusnap.capture.address_copy import DriverCopies, HostCopies, address_copies


def _state(seed: int, device: torch.device) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 8)).to(device)
    return {"model": model, "step": seed}


def _fast_save_and_restore(tmp_path, name: str, device: torch.device) -> dict[str, torch.Tensor]:
    state = _state(3, device)
    cfg = gpusnap.Config(chunk_size=4096, copy_piece_bytes=8192, fsync=False)
    with gpusnap.Checkpointer(tmp_path / f"{name}-d", config=cfg, fast_root=_fast_root(tmp_path, device) / name,
                              promote_every=10**6) as ck:
        info = ck.save(state).wait()
        assert info.tier == "fast"
        if device.type == "cuda":  # the precondition of the by-address path on CUDA: page-locked slabs
            assert info.stats["fast_register_errors"] == [], info.stats["fast_register_errors"]
        assert info.stats["copy_path"] == ("address" if address_copy.ENABLED else "torch"), info.stats["copy_path_why"]
        assert ("switched off" in info.stats["copy_path_why"]) == (not address_copy.ENABLED)  # it says why
        target = _state(9, device)
        ck.restore(target)
    return {k: v.clone() for k, v in target["model"].state_dict().items()}


def _fast_root(tmp_path, device: torch.device):
    """Where the fast tier's slabs can be page-locked: tmpfs (/dev/shm) where CUDA is (a file on a
    disk's file system is refused by the driver: the copies then go through torch); else any directory."""
    if not torch.cuda.is_available():
        return tmp_path
    import shutil
    import tempfile
    from pathlib import Path

    shm = Path(tempfile.mkdtemp(prefix="gpusnap-test-", dir="/dev/shm"))
    _cleanup.append(lambda: shutil.rmtree(shm, ignore_errors=True))
    return shm


_cleanup: list = []


@pytest.fixture(autouse=True)
def _remove_shm_roots():
    yield
    while _cleanup:
        _cleanup.pop()()


def test_a_snapshot_copied_by_address_restores_the_same_bytes(tmp_path, monkeypatch, device):
    calls = []
    engine = HostCopies if device.type == "cpu" else DriverCopies
    real = engine.copy
    monkeypatch.setattr(engine, "copy", lambda self, dst, src, n: calls.append(n) or real(self, dst, src, n))
    by_address = _fast_save_and_restore(tmp_path, "a", device)
    assert calls, "the snapshot went through torch, not the by-address copies"
    monkeypatch.setattr(address_copy, "ENABLED", False)
    calls.clear()
    through_torch = _fast_save_and_restore(tmp_path, "b", device)
    assert not calls
    expected = _state(3, device)["model"].state_dict()
    for key, value in expected.items():
        assert torch.equal(by_address[key], value) and torch.equal(through_torch[key], value)


def test_address_copies_picks_an_engine_per_device(monkeypatch):
    assert isinstance(address_copies(torch.device("cpu"), None), HostCopies)
    assert address_copies(torch.device("meta"), None) is None
    monkeypatch.setattr(address_copy, "ENABLED", False)
    assert address_copies(torch.device("cpu"), None) is None


class FakeDriver:
    """The driver functions DriverCopies calls; events complete when ``finish`` says so."""

    def __init__(self) -> None:
        self.next = 100
        self.pending: set[int] = set()
        self.recorded: list[int] = []
        self.destroyed: list[int] = []
        self.copies: list[tuple[int, int, int]] = []
        self.current = 0
        self.synced: list[int] = []

    @staticmethod
    def _out(ref):  # the object a byref() points to
        return ref._obj

    def cuDeviceGet(self, ref, index):
        self._out(ref).value = index
        return 0

    def cuDevicePrimaryCtxRetain(self, ref, device):
        self._out(ref).value = 7000 + device.value
        return 0

    def cuCtxGetCurrent(self, ref):
        self._out(ref).value = self.current or None
        return 0

    def cuCtxSetCurrent(self, ctx):
        self.current = ctx.value
        return 0

    def cuEventCreate(self, ref, flags):
        assert flags & 0x1, "a waited-on event must block, not spin"
        self.next += 1
        self._out(ref).value = self.next
        return 0

    def cuMemcpyDtoHAsync_v2(self, dst, src, n, stream):
        self.copies.append((dst.value, src.value, n.value))
        return 0

    def cuEventRecord(self, event, stream):
        assert event.value not in self.pending, "an event was recorded again while its copy ran"
        self.pending.add(event.value)
        self.recorded.append(event.value)
        return 0

    def cuEventQuery(self, event):
        return 600 if event.value in self.pending else 0

    def cuEventSynchronize(self, event):
        self.pending.discard(event.value)
        return 0

    def cuStreamSynchronize(self, stream):
        self.synced.append(stream.value)
        self.pending.clear()
        return 0

    def cuEventDestroy_v2(self, event):
        self.destroyed.append(event.value)
        return 0

    def cuGetErrorName(self, rc, ref):
        self._out(ref).value = b"CUDA_ERROR_FAKE"
        return 0

    def finish(self, handle: int) -> None:
        self.pending.discard(handle)


@pytest.fixture
def fake():
    return FakeDriver()  # a library of its own: its primary contexts are retained afresh


def test_driver_events_are_reused_only_once_complete(fake):
    stream = type("S", (), {"cuda_stream": 55})()
    engine = DriverCopies(fake, torch.device("cuda", 0), stream)  # type: ignore[arg-type]
    assert fake.current == 7000  # the device's primary context made current
    first = engine.copy(1 << 20, 1 << 30, 4096)
    first_handle = first.handle
    second = engine.copy(2 << 20, 2 << 30, 4096)
    assert first.handle != second.handle  # the first still runs: a new event
    handle = second.handle
    assert not second.query()
    fake.finish(handle)
    assert second.query()
    third = engine.copy(3 << 20, 3 << 30, 4096)
    assert third.handle == handle  # the completed event's handle, recorded again
    assert second.query(), "a completed event read the state of its handle's next recording"
    second.synchronize()  # a second wait returns at once and gives nothing back twice
    assert fake.pending == {first.handle, third.handle}
    first.synchronize()
    third.synchronize()
    fourth = engine.copy(4 << 20, 4 << 30, 8)
    assert fourth.handle in (first_handle, handle)  # no third event: both were free again
    engine.close()
    assert sorted(fake.destroyed) == sorted(set(fake.recorded))
    assert fake.copies[0] == (1 << 20, 1 << 30, 4096)


def test_a_driver_error_is_raised_with_its_name(fake):
    fake.cuMemcpyDtoHAsync_v2 = lambda *args: 1  # type: ignore[method-assign]
    stream = type("S", (), {"cuda_stream": 55})()
    engine = DriverCopies(fake, torch.device("cuda", 0), stream)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="cuMemcpyDtoHAsync failed: CUDA_ERROR_FAKE"):
        engine.copy(1, 2, 3)


def test_a_copy_whose_event_cannot_be_recorded_is_waited_for_before_it_raises(fake):
    fake.cuEventRecord = lambda event, stream: 1  # type: ignore[method-assign]
    stream = type("S", (), {"cuda_stream": 55})()
    engine = DriverCopies(fake, torch.device("cuda", 0), stream)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="cuEventRecord failed"):
        engine.copy(1, 2, 3)
    assert fake.copies == [(1, 2, 3)] and fake.synced == [55]  # queued, then waited for: its region may go back
    assert engine._free == [fake.next]  # the event's handle is not lost


def test_the_threads_context_is_given_back_after_the_copies(fake):
    fake.current = 4242  # another device's context, current on the copier thread
    stream = type("S", (), {"cuda_stream": 55})()
    engine = DriverCopies(fake, torch.device("cuda", 1), stream)  # type: ignore[arg-type]
    assert fake.current == 7001
    engine.restore_context()
    assert fake.current == 4242


def test_pageable_regions_on_cuda_are_copied_through_torch():
    from types import SimpleNamespace

    from gpusnap.capture.copier import Copier

    copier = Copier.__new__(Copier)
    copier.arena = SimpleNamespace(pinned=False)  # a tier whose page-locking was refused
    copier._engines = []
    assert copier._engine(torch.device("cuda", 0), object()) is None
    copier.arena = SimpleNamespace(pinned=False)
    assert isinstance(copier._engine(torch.device("cpu"), None), HostCopies)  # host memory: memmove


@pytest.mark.cuda
def test_driver_copies_a_device_buffer_into_pinned_memory():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    src = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(3 << 20, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    engine = address_copies(src.device, stream)
    assert isinstance(engine, DriverCopies)
    events = [engine.copy(dst.data_ptr() + k, src.data_ptr() + k, 1 << 20) for k in range(0, 3 << 20, 1 << 20)]
    for event in events:
        event.synchronize()
    engine.close()
    assert torch.equal(dst, src.cpu())
    assert ctypes.sizeof(ctypes.c_void_p) == 8


def test_a_fast_arena_is_page_locked_only_while_no_slab_was_refused():
    from types import SimpleNamespace

    from gpusnap.capture.fast_arena import FastArena

    tier = SimpleNamespace(pinned=True, register_errors=[])
    arena = FastArena(SimpleNamespace(tier=tier), 1 << 20)  # type: ignore[arg-type]
    assert arena.pinned
    tier.register_errors.append("slab 3: cudaHostRegister of 1073741824 bytes failed: error 1")
    assert not arena.pinned  # that slab is pageable: no by-address copies into the tier
