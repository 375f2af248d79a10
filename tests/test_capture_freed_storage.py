"""Issue 21, A1: storages freed, shrunk or grown (``untyped_storage().resize_``, as FSDP does
to its unsharded parameters) before save(), between save() and the copy, and while a piece
is being copied. Never a crash, a read of freed memory or a program storage grown back:
either the checkpoint holds the state at save(), or the save fails naming the tensor.

Cases that crashed the interpreter before the fix run in a fresh one (``run_isolated``)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import gpusnap

from capture_support import assert_bits, restored, run_isolated, tracked_config

_BEFORE_SAVE = r"""
import sys, tempfile, torch, gpusnap
numel = int(sys.argv[1])
configs = {
    "snapshot": gpusnap.Config(fsync=False),
    "tracked": gpusnap.Config(chunk_size=512, cpu_snapshot_bytes=0, eager_cpu_bytes=0, fsync=False),
    "stop-the-world": gpusnap.Config(concurrent=False, fsync=False),
}
for how, size in (("freed", 0), ("shrunk", 4)):
    for name, config in configs.items():
        for blocking in (False, True):
            victim = torch.arange(numel, dtype=torch.float32)
            victim.untyped_storage().resize_(size)
            state = {"fine": torch.ones(100), "model": {"victim": victim}}
            with gpusnap.Checkpointer(tempfile.mkdtemp() + "/ck", config=config) as ck:
                try:
                    ck.save(state, blocking=blocking).wait()
                except gpusnap.CheckpointError as exc:
                    assert "model/victim" in str(exc) and "resize_" in str(exc), str(exc)
                else:
                    raise AssertionError(f"{how}, {name}: a save of a {how} storage committed")
                assert ck.list() == []
            # the program's storage is left as the program made it: never grown back
            assert victim.untyped_storage().nbytes() == size, (how, name, victim.untyped_storage().nbytes())
print("OK")
"""


@pytest.mark.parametrize("numel", [10, 1 << 22], ids=["small", "large"])
def test_a_storage_freed_or_shrunk_before_save_fails_naming_the_tensor(numel: int) -> None:
    """Before the fix: a small one segfaulted in the gather copy (address 0), a large one
    committed junk with validation ok and grew the program's storage back."""
    run_isolated(_BEFORE_SAVE, str(numel))


_NULL_SOURCE = r"""
import torch
from gpusnap.kernels.gather_copy import gather_copy_host
out = torch.zeros(64, dtype=torch.uint8)
try:
    gather_copy_host(out, [0], [16], [8])  # a freed storage's data pointer (0) plus its offset
except ValueError as exc:
    assert "freed storage" in str(exc)
    print("OK")
"""


def test_the_gather_copy_refuses_a_source_in_the_null_page() -> None:
    """The last line of defence under the window's size checks: never a read at address ~0."""
    run_isolated(_NULL_SOURCE)


def test_a_storage_grown_before_save_is_saved_as_its_tensors_see_it(tmp_path: Any) -> None:
    t = torch.randn(1000)
    t.untyped_storage().resize_(t.untyped_storage().nbytes() * 3)  # its first bytes stay
    expected = {"t": t.clone()}
    with gpusnap.Checkpointer(tmp_path / "ck", config=tracked_config()) as ck:
        info = ck.save({"t": t}).wait()
        assert info.nbytes == 4000  # the span its tensors cover, not the whole storage
        assert_bits(restored(ck, expected, info.id), expected)


def _resize(storage: torch.UntypedStorage, how: str) -> int:
    size = {"freed": 0, "shrunk": 1000, "grown": storage.nbytes() * 2}[how]
    storage.resize_(size)
    return size


@pytest.mark.parametrize("budget", [1, 1 << 30], ids=["wait", "copy-on-write"])
@pytest.mark.parametrize("how", ["freed", "shrunk", "grown"])
def test_a_resize_between_save_and_its_copy_keeps_the_state_at_save(tmp_path: Any, gate: Any, how: str,
                                                                     budget: int) -> None:
    """The resize reaches no dispatcher: the window protects the span first (copy-on-write of
    what is not copied yet, or a wait for it), so the checkpoint holds the bytes of save()
    and the program's storage ends up as it asked."""
    state = {"a": torch.randn(4096), "b": torch.randn(100_000)}
    expected = {k: v.clone() for k, v in state.items()}
    with gpusnap.Checkpointer(tmp_path / "ck", config=tracked_config(cow_budget_bytes=budget)) as ck:
        pending = ck.save(state)  # the copier stalls on "a": "b" is pending
        storage = state["b"].untyped_storage()
        size = _resize(storage, how)
        gate.release()
        info = pending.wait(timeout=120)
        assert info.stats["validation"].startswith("ok") and "retry" not in info.stats["validation"]
        assert storage.nbytes() == size, "the program's storage must stay as the program resized it"
        assert_bits(restored(ck, expected, info.id), expected)
    assert "resize_" not in torch.UntypedStorage.__dict__, "nothing stays wrapped after the window"


_MID_COPY = r"""
import sys, tempfile, threading, torch, gpusnap
from gpusnap.capture.window import CaptureWindow

budget = int(sys.argv[1])
in_copy, go = threading.Event(), threading.Event()
held = []
source = CaptureWindow.source

def holding_source(self, ws, start, n):
    # the copier holds the window's lock here, between taking a piece's source and copying it
    src = source(self, ws, start, n)
    if ws.span.paths == ["b"] and start == 3 * 2048 and not held:
        held.append(start)
        in_copy.set()
        go.wait(60)  # until the program's resize has begun (or, without the guard, is done)
    return src

CaptureWindow.source = holding_source
if hasattr(CaptureWindow, "before_resize"):  # (the guard's entry: the resize has begun)
    before_resize = CaptureWindow.before_resize
    def signalling(self, storage):
        go.set()
        return before_resize(self, storage)
    CaptureWindow.before_resize = signalling

config = gpusnap.Config(chunk_size=512, staging_bytes=1 << 16, copy_piece_bytes=2048, cpu_snapshot_bytes=0,
                        eager_cpu_bytes=0, cow_budget_bytes=budget, fsync=False)
state = {"a": torch.randn(1000), "b": torch.randn(1 << 18)}  # b: 1 MiB, memory the allocator unmaps
expected = {k: v.clone() for k, v in state.items()}
storage = state["b"].untyped_storage()
with gpusnap.Checkpointer(tempfile.mkdtemp() + "/ck", config=config) as ck:
    pending = ck.save(state)
    assert in_copy.wait(60), "the copier never reached the held piece"

    def resize():
        storage.resize_(0)
        go.set()

    helper = threading.Thread(target=resize)
    helper.start()
    info = pending.wait(timeout=120)
    helper.join(60)
    assert not helper.is_alive()
    assert storage.nbytes() == 0, storage.nbytes()
    fresh = {k: torch.zeros_like(v) for k, v in expected.items()}
    ck.restore(fresh, info.id)
    for k in expected:
        assert torch.equal(fresh[k], expected[k]), k
print("OK", info.stats["bytes_cow"], info.stats["waits"])
"""


@pytest.mark.parametrize("budget", [1, 1 << 30], ids=["wait", "copy-on-write"])
def test_a_storage_freed_while_its_piece_is_being_copied_is_never_read_freed(budget: int) -> None:
    """Adversarial schedule: the program frees the storage exactly while the copier copies
    one of its pieces. The resize waits for that copy (the window's lock), then protects
    the rest. Before the fix: a use-after-free (SIGSEGV in the copier)."""
    out = run_isolated(_MID_COPY, str(budget))
    _, cow, waits = out.split()
    if budget > 1:
        assert int(cow) > 0  # the rest of the span was shadowed before it was freed
    else:
        assert int(waits) >= 1  # the resize waited until the span was copied


def test_a_resize_that_bypasses_python_fails_the_save_naming_the_tensor(tmp_path: Any, gate: Any) -> None:
    """A resize no hook sees (C++ code calling the storage's resize directly): the copier
    finds the storage short before it reads it, and fails the save; it never grows it back."""
    state = {"a": torch.randn(4096), "b": torch.randn(10_000)}
    with gpusnap.Checkpointer(tmp_path / "ck", config=tracked_config(retry_validation=False)) as ck:
        pending = ck.save(state)
        storage = state["b"].untyped_storage()
        torch._C.StorageBase.resize_(storage, 0)  # what C++ code does: no Python method runs
        gate.release()
        with pytest.raises(gpusnap.CheckpointError, match=r"\bb\b.*freed"):
            pending.wait(timeout=120)
        assert storage.nbytes() == 0, "gpusnap grew the program's storage back"
        assert ck.list() == []
        # the next save refuses the freed storage up front
        with pytest.raises(gpusnap.CheckpointError, match="b: the tensor's storage was freed"):
            ck.save(state)


def test_an_opaque_op_over_a_storage_freed_unseen_fails_the_save_not_the_op(tmp_path: Any, gate: Any) -> None:
    """An op the tracker treats as writing everything (a higher-order op) while a pending
    span's storage was freed unseen: the op runs; the save fails naming the tensor."""
    state = {"a": torch.randn(4096), "b": torch.randn(10_000), "c": torch.randn(3)}
    with gpusnap.Checkpointer(tmp_path / "ck", config=tracked_config(cow_budget_bytes=1 << 30)) as ck:
        pending = ck.save(state)
        storage = state["b"].untyped_storage()
        torch._C.StorageBase.resize_(storage, 0)
        out = torch.cond(state["c"].sum() > 0, lambda x: x + 1, lambda x: x - 1, (state["c"],))
        assert out.shape == (3,)
        gate.release()
        with pytest.raises(gpusnap.CheckpointError, match=r"\bb\b.*freed"):
            pending.wait(timeout=120)
        assert storage.nbytes() == 0


def test_the_resize_guard_is_installed_only_while_a_tracked_window_is_open(tmp_path: Any, gate: Any) -> None:
    from gpusnap.capture import resize_guard

    assert "resize_" not in torch.UntypedStorage.__dict__
    state = {"a": torch.randn(4096), "b": torch.randn(1000)}
    with gpusnap.Checkpointer(tmp_path / "ck", config=tracked_config()) as ck:
        pending = ck.save(state)
        assert torch.UntypedStorage.__dict__.get("resize_") is resize_guard._resize_
        gate.release()
        pending.wait(timeout=120)
        assert "resize_" not in torch.UntypedStorage.__dict__
        # a snapshot window reads no live storage after save(): nothing to guard
    with gpusnap.Checkpointer(tmp_path / "snap") as ck:
        pending = ck.save(state)
        assert "resize_" not in torch.UntypedStorage.__dict__
        pending.wait(timeout=120)


# -- CUDA (the lead runs these on the GPU) ---------------------------------------------------------
@pytest.mark.cuda
def test_cuda_a_freed_storage_never_reaches_the_device_gather(tmp_path: Any) -> None:
    """Before save(): refused by flatten, before the gather kernel reads its address (an
    illegal memory access there would be sticky and end the program's CUDA context)."""
    dev = torch.device("cuda")
    configs = [gpusnap.Config(fsync=False),  # whole-state snapshot: the gather kernel
               gpusnap.Config(fsync=False, device_snapshot=False, eager_device_bytes=0),  # tracked
               gpusnap.Config(fsync=False, device_snapshot=False)]  # small spans gathered at save()
    for numel in (10, 1 << 24):
        for config in configs:
            victim = torch.arange(numel, dtype=torch.float32, device=dev)
            victim.untyped_storage().resize_(0)
            state = {"fine": torch.ones(1000, device=dev), "victim": victim}
            with gpusnap.Checkpointer(tmp_path / f"ck{numel}{id(config)}", config=config) as ck:
                with pytest.raises(gpusnap.CheckpointError, match="victim"):
                    ck.save(state).wait()
            assert victim.untyped_storage().nbytes() == 0
    torch.cuda.synchronize()  # no sticky error
    assert torch.ones(4, device=dev).sum().item() == 4


@pytest.mark.cuda
def test_cuda_a_storage_freed_through_resize_while_its_piece_is_taken_keeps_the_state(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tracked CUDA window; the program frees a storage (``resize_``) while the copier takes
    one of its pieces: the resize waits for that piece, then protects the rest; the
    checkpoint is the state at save(), and no illegal memory access happens."""
    from gpusnap.capture.window import CaptureWindow

    dev = torch.device("cuda")
    in_copy, go = threading.Event(), threading.Event()
    source = CaptureWindow.source

    def holding_source(self: Any, ws: Any, start: int, n: int) -> Any:
        src = source(self, ws, start, n)
        if ws.span.paths == ["b"] and start == 3 * (1 << 20) and not in_copy.is_set():
            in_copy.set()
            go.wait(60)
        return src

    before_resize = CaptureWindow.before_resize

    def signalling(self: Any, storage: Any) -> None:
        go.set()
        before_resize(self, storage)

    monkeypatch.setattr(CaptureWindow, "source", holding_source)
    monkeypatch.setattr(CaptureWindow, "before_resize", signalling)
    state = {"a": torch.randn(1 << 20, device=dev), "b": torch.randn(16 << 20, device=dev)}
    expected = {k: v.clone() for k, v in state.items()}
    storage = state["b"].untyped_storage()
    with gpusnap.Checkpointer(tmp_path / "ck", config=_cuda_tracked()) as ck:
        pending = ck.save(state)
        assert in_copy.wait(60)
        helper = threading.Thread(target=storage.resize_, args=(0,))
        helper.start()
        info = pending.wait(timeout=120)
        helper.join(60)
        junk = torch.full((16 << 20,), 3.0, device=dev)  # the allocator's next block
        got = {k: torch.zeros_like(v) for k, v in expected.items()}
        ck.restore(got, info.id)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
        del junk
    assert storage.nbytes() == 0
    torch.cuda.synchronize()


@pytest.mark.cuda
def test_cuda_a_storage_freed_unseen_under_copies_in_flight_fails_the_save(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The program frees a storage from outside Python (no hook sees it) while copies of it
    are in flight on the copy stream: they still read memory the caching allocator keeps
    for them (recorded on the copy stream); the next piece finds the storage short and the
    save fails naming it. No illegal memory access, no storage grown back."""
    from gpusnap.capture import copier
    from gpusnap.capture.window import CaptureWindow

    dev = torch.device("cuda")
    taken, in_flight, go = threading.Event(), threading.Event(), threading.Event()
    source, wait_event = CaptureWindow.source, copier.wait_event

    def noting_source(self: Any, ws: Any, start: int, n: int) -> Any:
        if ws.span.paths == ["b"] and start == 3 * (1 << 20):
            taken.set()  # this piece's copy is being enqueued
        return source(self, ws, start, n)

    def holding_wait(event: Any) -> None:
        if taken.is_set() and not in_flight.is_set():  # (one copy ahead: the wait for that piece)
            in_flight.set()  # its copy is enqueued, not waited for
            go.wait(60)
        wait_event(event)

    monkeypatch.setattr(CaptureWindow, "source", noting_source)
    monkeypatch.setattr(copier, "wait_event", holding_wait)
    state = {"a": torch.randn(1 << 20, device=dev), "b": torch.randn(16 << 20, device=dev)}
    storage = state["b"].untyped_storage()
    with gpusnap.Checkpointer(tmp_path / "ck", config=_cuda_tracked(copy_ahead=1)) as ck:
        pending = ck.save(state)
        assert in_flight.wait(60)
        torch._C.StorageBase.resize_(storage, 0)
        junk = torch.full((16 << 20,), 3.0, device=dev)
        go.set()
        with pytest.raises(gpusnap.CheckpointError, match=r"\bb\b.*freed"):
            pending.wait(timeout=120)
        del junk
    assert storage.nbytes() == 0
    torch.cuda.synchronize()


def _cuda_tracked(**kw: Any) -> gpusnap.Config:
    return gpusnap.Config(chunk_size=1 << 20, copy_piece_bytes=1 << 20, device_snapshot=False,
                          eager_device_bytes=0, retry_validation=False, fsync=False, **kw)
