"""Issue 21, C10: inside a tracked window the program's ops never fail because of gpusnap.
Sparse and other storage-less tensors, higher-order ops (protected as opaque work), a
copy-on-write shadow that finds no memory (it waits instead, and gives its budget back),
and any failure of gpusnap's own bookkeeping (the save fails, never the op)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import gpusnap
from gpusnap.capture.window import CaptureWindow, buffers_from

from capture_support import assert_bits, restored, tracked_config

HUGE = 1 << 30


def _state() -> dict[str, torch.Tensor]:
    return {"a": torch.randn(4096), "b": torch.randn(1000), "c": torch.randn(16)}


@pytest.fixture
def windows(monkeypatch: pytest.MonkeyPatch) -> list[CaptureWindow]:
    """Every window that protected something."""
    seen: list[CaptureWindow] = []
    protect_many = CaptureWindow.protect_many

    def recording(self: CaptureWindow, targets: Any) -> None:
        if self not in seen:
            seen.append(self)
        protect_many(self, targets)

    monkeypatch.setattr(CaptureWindow, "protect_many", recording)
    return seen


def _in_window(tmp_path: Any, gate: Any, program: Callable[[dict[str, torch.Tensor]], None],
               **config: Any) -> tuple[gpusnap.CheckpointInfo, dict[str, torch.Tensor]]:
    """Run ``program`` while a tracked window holds every span but the first pending; the
    checkpoint must be the state at save()."""
    state = _state()
    at_save = {k: v.clone() for k, v in state.items()}
    with gpusnap.Checkpointer(tmp_path / "ck", config=tracked_config(**config)) as ck:
        pending = ck.save(state)
        program(state)
        gate.release()
        info = pending.wait(timeout=120)
        assert "retry" not in info.stats["validation"], info.stats["validation"]
        assert_bits(restored(ck, at_save, info.id), at_save)
    return info, state


@pytest.mark.filterwarnings("ignore::UserWarning")  # (sparse CSR is beta; invariant checks off)
def test_sparse_tensors_in_a_window(tmp_path: Any, gate: Any) -> None:
    """Ops on sparse tensors ran into ``untyped_storage()`` of a sparse tensor; a sparse
    tensor made over a window tensor's values protects that tensor's storage."""
    def program(state: dict[str, torch.Tensor]) -> None:
        sp = torch.eye(4).to_sparse()
        sp.mul_(2.0)
        assert torch.equal(sp.to_dense(), 2 * torch.eye(4))
        csr = torch.eye(4).to_sparse_csr()
        csr.mul_(3.0)
        aliased = torch.sparse_coo_tensor(torch.tensor([list(range(16))]), state["c"], (32,))
        aliased.add_(aliased)  # may write the values, which are state["c"]'s storage

    info, _ = _in_window(tmp_path, gate, program, cow_budget_bytes=HUGE)
    assert info.stats["bytes_cow"] >= 16 * 4  # "c" was shadowed before the sparse op


def test_a_tensor_with_an_opaque_layout_is_protected_as_writing_everything(tmp_path: Any, gate: Any) -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("needs mkldnn")

    def program(state: dict[str, torch.Tensor]) -> None:
        mk = torch.randn(8).to_mkldnn()  # no storage gpusnap can name
        mk.add_(mk)
        state["a"].add_(1.0)

    info, _ = _in_window(tmp_path, gate, program, cow_budget_bytes=HUGE)
    assert info.stats["opaque_launches"] >= 1


def _cond(state: dict[str, torch.Tensor]) -> None:
    c = state["c"]
    out = torch.cond(c.sum() > -1e9, lambda x: x + 1, lambda x: x - 1, (c,))
    assert torch.equal(out, c + 1)


def _while_loop(state: dict[str, torch.Tensor]) -> None:
    from torch._higher_order_ops.while_loop import while_loop

    i, x = while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x * 2), (torch.tensor(0), state["c"]))
    assert i.item() == 3 and torch.equal(x, state["c"] * 8)


def _map(state: dict[str, torch.Tensor]) -> None:
    from torch._higher_order_ops.map import map as hop_map

    assert torch.equal(hop_map(lambda x: x * 2, state["c"].view(4, 4)), state["c"].view(4, 4) * 2)


def _flex_attention(state: dict[str, torch.Tensor]) -> None:
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    q = state["c"].view(1, 1, 2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention recommends torch.compile
        out = flex_attention(q, q, q)
    assert out.shape == q.shape


@pytest.mark.parametrize("hop", [_cond, _while_loop, _map, _flex_attention], ids=lambda f: f.__name__[1:])
def test_higher_order_ops_run_in_a_window_as_opaque_work(tmp_path: Any, gate: Any, hop: Any) -> None:
    """Before: "There was no rule registered for HigherOrderOperator ...". A higher-order
    op runs code below the mode (its bodies): it counts as an opaque launch, every pending
    span is protected first; the program's later writes stay tracked."""
    def program(state: dict[str, torch.Tensor]) -> None:
        hop(state)
        state["b"].mul_(2.0)
        state["c"].add_(1.0)

    info, _ = _in_window(tmp_path, gate, program, cow_budget_bytes=HUGE, retry_validation=False)
    assert info.stats["opaque_launches"] >= 1
    assert info.stats["bytes_cow"] >= (1000 + 16) * 4  # every pending span shadowed at the op


def test_a_higher_order_op_over_budget_waits_for_every_pending_span(tmp_path: Any, gate: Any) -> None:
    info, _ = _in_window(tmp_path, gate, _cond, cow_budget_bytes=1, retry_validation=False)
    assert info.stats["opaque_launches"] >= 1 and info.stats["waits"] >= 2 and info.stats["bytes_cow"] == 0


def test_a_shadow_that_finds_no_memory_waits_instead(tmp_path: Any, gate: Any, windows: list[CaptureWindow]) -> None:
    """The shadow's allocation raises OutOfMemoryError once: the op still runs, the span is
    copied first and waited for, the budget it had counted goes back."""
    failed: list[int] = []

    def out_of_memory_once(nbytes: int, device: torch.device) -> torch.Tensor:
        if not failed:
            failed.append(nbytes)
            raise torch.OutOfMemoryError("simulated: no room for the copy-on-write shadow")
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def program(state: dict[str, torch.Tensor]) -> None:
        with buffers_from(out_of_memory_once):
            state["b"].add_(1.0)  # would be shadowed (within budget): the shadow fails
        assert windows and windows[0].cow_used == 0, "the failed shadow's budget must go back"

    info, state = _in_window(tmp_path, gate, program, cow_budget_bytes=HUGE)
    assert failed == [state["b"].nbytes]  # b's shadow, the only buffer asked for
    assert info.stats["waits"] >= 1 and info.stats["bytes_cow"] == 0
    assert windows[0].cow_used == 0
    assert windows[0].stats.cow_failures == 1


def test_a_failure_in_the_trackers_bookkeeping_fails_the_save_not_the_op(tmp_path: Any, gate: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from gpusnap.capture import tracker

    def broken(func: Any, args: Any, kwargs: Any) -> Any:
        raise RuntimeError("simulated bug in gpusnap's speculation")

    working = tracker.written_tensors
    monkeypatch.setattr(tracker, "written_tensors", broken)
    state = _state()
    expected = state["b"] + 1.0
    with gpusnap.Checkpointer(tmp_path / "ck", config=tracked_config()) as ck:
        pending = ck.save(state)
        state["b"].add_(1.0)  # the program's op runs as asked
        assert torch.equal(state["b"], expected)
        gate.release()
        with pytest.raises(gpusnap.CheckpointError, match="add_.*simulated bug"):
            pending.wait(timeout=120)
        assert ck.list() == []
        monkeypatch.setattr(tracker, "written_tensors", working)  # the next save commits
        info = ck.save(state).wait(timeout=120)
        assert_bits(restored(ck, state, info.id), state)


# -- CUDA (the lead runs this on the GPU) --------------------------------------------------------
@pytest.mark.cuda
def test_cuda_a_shadow_that_hits_a_real_out_of_memory_waits_instead(tmp_path: Any, gate: Any,
                                                                    windows: list[CaptureWindow]) -> None:
    """cow_budget_bytes allows the shadow, the device does not: the write waits for the
    span's copy, the checkpoint is the state at save(), and the budget comes back."""
    dev = torch.device("cuda")
    state = {"a": torch.randn(1 << 20, device=dev), "b": torch.randn(512 << 20, device=dev)}  # b: 2 GiB
    at_save = {k: v.clone() for k, v in state.items()}
    config = gpusnap.Config(chunk_size=1 << 20, copy_piece_bytes=1 << 20, staging_bytes=4 << 20,
                            device_snapshot=False, eager_device_bytes=0, cow_budget_bytes=1 << 40,
                            fsync=False)
    filler: list[torch.Tensor] = []
    with gpusnap.Checkpointer(tmp_path / "ck", config=config) as ck:
        pending = ck.save(state)
        torch.cuda.synchronize()
        block = 1 << 30
        while block >= 64 << 20:  # fill the device, leaving less than b's shadow free (< 128 MiB)
            try:
                filler.append(torch.empty(block, dtype=torch.uint8, device=dev))
            except torch.OutOfMemoryError:
                block //= 2
        state["b"].add_(1.0)  # in place: the op itself needs no memory
        filler.clear()
        gate.release()
        info = pending.wait(timeout=300)
        assert info.stats["waits"] >= 1 and info.stats["bytes_cow"] == 0
        assert windows[0].cow_used == 0 and windows[0].stats.cow_failures >= 1
        got = {k: torch.zeros_like(v) for k, v in at_save.items()}
        ck.restore(got, info.id)
        assert all(torch.equal(got[k], at_save[k]) for k in at_save)
    torch.cuda.synchronize()
