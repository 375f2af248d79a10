"""Lazy restore seen through doors the dispatch-mode gate does not watch (issue 21, A2).

Every way of reading a tensor not yet loaded must see its restored bytes (or the restore
finishes before it can be observed): C methods that read memory (``tolist``, ``numpy``,
DLPack, ``data_ptr``), formatting (``repr``, ``print``, f-strings), pickling and
``torch.save``, ``copy.deepcopy``, on the thread that restored and on any other; a forward
after an inference-mode block that began the restore; and a write from a thread the gate
does not cover must not be lost silently.

Loading is held (``restore_hold``) until something waits for it: a door that does not wait
returns the pre-restore bytes, deterministically.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import io
import logging
import pickle
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.dlpack
from restore_hold import Hold, hold_loads, snapshot
from restore_support import tiny_config
from torch import nn

import gpusnap
from gpusnap import CheckpointError

N = 512  # floats: 4 chunks of 512 bytes, one piece


def _bytes(value: Any) -> Any:
    """What a door returned, comparable: tensors and arrays as their bytes."""
    if isinstance(value, torch.Tensor):
        return snapshot(value).cpu().numpy().tobytes()
    if isinstance(value, np.ndarray):
        return value.tobytes()
    return value


def _from_dlpack(capsule: Any) -> Any:
    return _bytes(torch.from_dlpack(capsule))  # (an alias of the memory: copied out at once)


def _torch_save(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _storage_bytes(storage: Any) -> bytes:
    with warnings.catch_warnings():  # (torch.load gives a TypedStorage back, deprecated)
        warnings.simplefilter("ignore", UserWarning)
        return bytes(storage.untyped().tolist() if hasattr(storage, "untyped") else storage.tolist())


def _print(t: torch.Tensor) -> str:
    out = io.StringIO()
    print(t, file=out)
    return out.getvalue()


DOORS: dict[str, Callable[[torch.Tensor], Any]] = {
    "tolist": lambda t: t.tolist(),
    "repr": repr,
    "str": str,
    "print": _print,
    "f-string": lambda t: f"{t}",
    "format-0d": lambda t: f"{t[3]:.4f}" if t.dim() else f"{t:.4f}",
    "torch.save": lambda t: _bytes(_torch_save(t)),
    "pickle": lambda t: _bytes(pickle.loads(pickle.dumps(t))),
    "copy.copy": lambda t: _bytes(copy.copy(t).clone()),
    "deepcopy": lambda t: _bytes(copy.deepcopy(t)),
    "__dlpack__": lambda t: _from_dlpack(t.__dlpack__()),
    "to_dlpack": lambda t: _from_dlpack(torch.utils.dlpack.to_dlpack(t)),
    "torch.to_dlpack": lambda t: _from_dlpack(torch.to_dlpack(t)),
    "numpy": lambda t: t.numpy().copy(),
    "np.asarray": lambda t: np.asarray(t).copy(),
    "data_ptr": lambda t: ctypes.string_at(t.data_ptr(), t.nbytes),
    "storage.data_ptr": lambda t: ctypes.string_at(t.untyped_storage().data_ptr(), t.nbytes),
    "storage.tolist": lambda t: t.untyped_storage().tolist(),
    "torch.save(storage)": lambda t: _storage_bytes(_torch_save(t.untyped_storage())),
}


def _on(thread: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` on this thread or on a new one (a logging or helper thread)."""
    if thread == "same":
        return fn()
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 (re-raised on the test's thread)
            out.append(("error", exc))

    worker = threading.Thread(target=run, name="helper")
    worker.start()
    worker.join(120)
    assert out, "the helper thread hung"
    kind, value = out[0]
    if kind == "error":
        raise value
    return value


@contextlib.contextmanager
def _lazily_restored(tmp_path, monkeypatch, source: dict[str, Any], target: dict[str, Any],
                     **restore: Any) -> Iterator[tuple[Any, Hold]]:
    """``source`` saved, then restored lazily into ``target`` with loading held: yields
    (handle, hold) while nothing is loaded yet."""
    with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        ck.save(source, blocking=True)
        hold = hold_loads(monkeypatch)
        handle = ck.restore(target, lazy=True, **restore)
        try:
            yield handle, hold
        finally:
            hold.release("test end")
            with contextlib.suppress(CheckpointError):
                handle.wait()


@pytest.mark.parametrize("thread", ["same", "other"])
@pytest.mark.parametrize("door", sorted(DOORS))
def test_every_door_sees_restored_bytes(tmp_path, monkeypatch, door, thread):
    source = {"t": torch.arange(N, dtype=torch.float32) * 0.25 + 1.0}
    target = {"t": torch.zeros(N)}
    expected = _bytes(DOORS[door](source["t"]))
    stale = _bytes(DOORS[door](torch.zeros(N)))
    assert expected != stale
    with _lazily_restored(tmp_path, monkeypatch, source, target) as (handle, hold):
        assert snapshot(target["t"]).eq(0).all(), "nothing is loaded before the door is used"
        seen = _bytes(_on(thread, lambda: DOORS[door](target["t"])))
        assert seen == expected, f"{door} on the {thread} thread read the bytes before the restore"
        assert hold.waits == ["span"], "the door itself waited for the tensor"
    assert torch.equal(target["t"], source["t"])


CUDA_DOORS = ("tolist", "repr", "torch.save", "pickle", "deepcopy", "format-0d")


@pytest.mark.cuda
@pytest.mark.parametrize("thread", ["same", "other"])
@pytest.mark.parametrize("door", CUDA_DOORS)
def test_doors_on_cuda_tensors_order_the_threads_stream(tmp_path, monkeypatch, door, thread):
    """The door returns once the copy is queued; the thread's own stream must then wait for
    it (another thread's current stream is not the one the gate ordered for the program)."""
    source = {"t": (torch.arange(1 << 20, dtype=torch.float32) * 0.5).cuda()}
    target = {"t": torch.zeros(1 << 20, device="cuda")}
    expected = _bytes(DOORS[door](source["t"]))
    with _lazily_restored(tmp_path, monkeypatch, source, target) as (handle, hold):
        seen = _bytes(_on(thread, lambda: DOORS[door](target["t"])))
        assert seen == expected, f"{door} on the {thread} thread read a CUDA tensor before its copy"
        assert hold.waits == ["span"]


@pytest.mark.parametrize("thread", ["same", "other"])
def test_zero_dim_tensor_formatted_on_any_thread(tmp_path, monkeypatch, thread):
    source, target = {"s": torch.tensor(3.25)}, {"s": torch.tensor(0.0)}
    with _lazily_restored(tmp_path, monkeypatch, source, target) as (_, hold):
        assert _on(thread, lambda: f"{target['s']:.2f}") == "3.25"
        assert hold.waits == ["span"]


def _trained(seed: int, x: torch.Tensor) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(x).square().mean().backward()
    optim.step()
    return model, optim


@pytest.mark.parametrize("thread", ["same", "other"])
def test_torch_save_of_optimizer_state_and_deepcopy_of_a_module(tmp_path, monkeypatch, thread):
    x = torch.randn(4, 8)
    model, optim = _trained(0, x)
    other, other_optim = _trained(1, x * 3)  # state of the same shapes, other values
    expected = copy.deepcopy(optim.state_dict()["state"])
    with _lazily_restored(tmp_path, monkeypatch, {"m": model, "o": optim}, {"m": other, "o": other_optim}):
        saved = _on(thread, lambda: _torch_save(other_optim.state_dict()))
        copied = _on(thread, lambda: copy.deepcopy(other))
    for index, state in expected.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(saved["state"][index][key], state[key]), (index, key)
    for a, b in zip(copied.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert isinstance(next(copied.parameters()), nn.Parameter)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


@torch.inference_mode()
def _restore_in_inference_mode(ck: gpusnap.Checkpointer, state: dict[str, Any]) -> Any:
    return ck.restore(state, lazy=True)


@pytest.mark.parametrize("how", ["block", "decorator"])
def test_forward_after_inference_mode_that_began_the_restore(tmp_path, monkeypatch, how, caplog):
    """Leaving inference mode drops the gate's dispatch key: such a restore is not lazy."""
    x = torch.randn(4, 16)
    source, target = _model(0), _model(1)
    expected = source(x).detach()
    with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        ck.save({"model": source}, blocking=True)
        hold = hold_loads(monkeypatch)
        try:
            with caplog.at_level(logging.WARNING, logger="gpusnap"):
                if how == "block":
                    with torch.inference_mode():
                        handle = ck.restore({"model": target}, lazy=True)
                else:
                    handle = _restore_in_inference_mode(ck, {"model": target})
            out = target(x)
        finally:
            hold.release("test end")
        handle.wait()
    assert torch.equal(out, expected), "the forward ran on weights not yet restored"
    assert handle.stats["mode"] == "eager"
    assert "inference_mode" in handle.stats["lazy_refused"]
    assert any("restores eagerly" in r.getMessage() for r in caplog.records)


def test_gate_kept_through_a_nested_inference_mode_exit(tmp_path, monkeypatch):
    """restore(lazy=True) under inference_mode(False) nested in inference mode stays lazy: the
    exits of both guards would drop the gate's key; the inference_mode door gives it back."""
    x = torch.randn(4, 16)
    source, target = _model(0), _model(1)
    expected = source(x).detach()
    with _lazily_restored_in(tmp_path, monkeypatch, source, target) as handle:
        out_inside = target(x)  # still inside the outer inference mode: gated
        assert torch.equal(out_inside, expected)
    assert handle.stats["mode"] == "lazy" and handle.stats["waits"] >= 1


@contextlib.contextmanager
def _lazily_restored_in(tmp_path, monkeypatch, source, target) -> Iterator[Any]:
    with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        ck.save({"model": source}, blocking=True)
        hold = hold_loads(monkeypatch)
        try:
            with torch.inference_mode():
                with torch.inference_mode(False):
                    handle = ck.restore({"model": target}, lazy=True)
                yield handle
        finally:
            hold.release("test end")
        handle.wait()


def test_forward_after_the_nested_guards_exit(tmp_path, monkeypatch):
    x = torch.randn(4, 16)
    source, target = _model(0), _model(1)
    expected = source(x).detach()
    with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        ck.save({"model": source}, blocking=True)
        hold = hold_loads(monkeypatch)
        try:
            with torch.inference_mode(), torch.inference_mode(False):
                handle = ck.restore({"model": target}, lazy=True)
            out = target(x)  # after both guards exited
        finally:
            hold.release("test end")
        handle.wait()
    assert torch.equal(out, expected)
    assert handle.stats["mode"] == "lazy" and handle.stats["waits"] >= 1


def test_a_guard_no_door_sees_is_detected(tmp_path, monkeypatch, caplog):
    """A ``with torch._C._InferenceMode(...)`` block entered before the restore drops the
    gate's key on exit without passing a door: ops then pass the gate unseen (the limit);
    the next gpusnap call on the thread says so (WARNING, ``stats["gate_dropped"]``)."""
    source = {"a": torch.arange(N, dtype=torch.float32)}
    target = {"a": torch.zeros(N)}
    with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        ck.save(source, blocking=True)
        hold = hold_loads(monkeypatch)
        try:
            with torch._C._InferenceMode(True), torch._C._InferenceMode(False):
                handle = ck.restore(target, lazy=True)
            with caplog.at_level(logging.WARNING, logger="gpusnap"):
                handle.wait()
        finally:
            hold.release("test end")
    assert any("without its dispatch key" in r.getMessage() for r in caplog.records)
    assert handle.stats["gate_dropped"] == 1
    assert handle.stats["mode"] == "lazy"


def test_lazy_restore_then_serving_in_inference_mode_is_gated(tmp_path, monkeypatch):
    x = torch.randn(4, 16)
    source, target = _model(0), _model(1)
    expected = source(x).detach()
    with _lazily_restored(tmp_path, monkeypatch, {"model": source}, {"model": target}) as (handle, _):
        with torch.inference_mode():
            out = target(x)
    assert torch.equal(out, expected)
    assert handle.stats["mode"] == "lazy"


def test_a_write_from_a_thread_the_gate_does_not_cover_fails_the_restore(tmp_path, monkeypatch):
    """Another thread's ATen ops are not gated (the user's responsibility: handle.wait()
    first); a write among them is detected by the target's version counter, never lost
    silently, and the state it left is refused by saves."""
    source = {"a": torch.arange(N, dtype=torch.float32), "b": torch.ones(N)}
    target = {"a": torch.zeros(N), "b": torch.zeros(N)}
    with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        ck.save(source, blocking=True)
        hold = hold_loads(monkeypatch)
        handle = ck.restore(target, lazy=True)
        try:
            _on("other", lambda: target["a"].add_(1))  # ungated: computes on the stale zeros
        finally:
            hold.release("test end")
        with pytest.raises(CheckpointError, match=r"(?s)\ba\b.*gate did not see.*handle\.wait\(\)"):
            handle.wait()
        with pytest.raises(CheckpointError, match="restore again before saving"):
            ck.save(target)
        with pytest.raises(CheckpointError, match="gate did not see"):
            target["a"] + 0  # never computes on what that write left


def test_doors_are_wrapped_only_while_a_restore_loads(tmp_path, monkeypatch):
    from gpusnap.restore.lazy import doors

    assert not doors.installed() and "tolist" not in vars(torch.Tensor)
    before = {name: vars(owner).get(name) for owner, name in doors.DOORS}
    source, target = {"t": torch.ones(N)}, {"t": torch.zeros(N)}
    with _lazily_restored(tmp_path, monkeypatch, source, target) as (handle, _):
        assert doors.installed() and "tolist" in vars(torch.Tensor)
        handle.wait()
        assert not doors.installed(), "removed with the last live gate"
    assert {name: vars(owner).get(name) for owner, name in doors.DOORS} == before
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist
