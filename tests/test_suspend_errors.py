"""Suspend and resume given what they cannot do: a clear error, and nothing lost or half moved.

Also what the program may do to a suspended state meanwhile (replace a tensor, give a
storage other memory, drop it) and what resume then does with it.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from torch import nn

from gpusnap import CheckpointError
from gpusnap.moving import suspend
from gpusnap.moving.swap import exchange_all


def _addresses(*tensors: torch.Tensor) -> list[int]:
    return [t.data_ptr() for t in tensors]


def test_app_state_must_be_a_mapping() -> None:
    with pytest.raises(CheckpointError, match="must be a mapping"):
        suspend([torch.randn(2)])  # type: ignore[arg-type]


def test_only_cuda_and_cpu_devices() -> None:
    with pytest.raises(CheckpointError, match="CUDA device or 'cpu'"):
        suspend({"t": torch.randn(2)}, device="meta")


def test_memory_torch_does_not_own_is_refused_before_anything_moves(device: torch.device) -> None:
    first = torch.randn(16, device=device)
    shared = torch.from_numpy(np.arange(8, dtype=np.float32))  # numpy owns this memory
    if device.type == "cuda":
        shared = torch.from_dlpack(torch.randn(8, device=device).__dlpack__())  # (DLPack: not PyTorch's allocation to free)
    before = _addresses(first, shared)
    with pytest.raises(CheckpointError, match=r"shared: its memory is not PyTorch's.*Nothing was moved"):
        suspend({"first": first, "shared": shared}, device=device)
    assert _addresses(first, shared) == before


def test_a_sparse_tensor_is_refused_naming_it() -> None:
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (3,), check_invariants=True)
    with pytest.raises(CheckpointError, match=r"layers/0/sp: a torch.sparse_coo tensor"):
        suspend({"layers": [{"sp": sparse}]}, device="cpu")


def test_a_second_suspend_of_the_same_state_is_refused(device: torch.device) -> None:
    t, other = torch.randn(8, device=device), torch.randn(8, device=device)
    s = suspend({"t": t}, device=device)
    address = other.data_ptr()
    with pytest.raises(CheckpointError, match=r"t: suspended already.*Nothing was moved"):
        suspend({"other": other, "t": t}, device=device)
    assert other.data_ptr() == address  # not moved either
    s.resume()
    suspend({"other": other, "t": t}, device=device).resume()  # resumed: suspendable again


def test_resume_twice_is_refused(device: torch.device) -> None:
    t = torch.randn(8, device=device)
    s = suspend({"t": t}, device=device)
    s.resume()
    with pytest.raises(CheckpointError, match="resumed already"):
        s.resume()
    assert s.state == "resumed"


def test_a_suspended_storage_cannot_be_resized(device: torch.device) -> None:
    """Its memory is the host copy's, not the allocator's: torch refuses the resize clearly."""
    t = torch.randn(8, device=device)
    s = suspend({"t": t}, device=device)
    with pytest.raises(RuntimeError, match="not resizable"):
        t.untyped_storage().resize_(0)
    s.resume()
    t.untyped_storage().resize_(t.untyped_storage().nbytes())  # its own again


class _Graph(torch.cuda.CUDAGraph):
    """Stands for a captured graph on CPU machines (torch's CPU build cannot make one)."""

    def __new__(cls) -> _Graph:  # (the CPU build's base refuses to be made)
        return object.__new__(cls)

    def __init__(self) -> None:
        pass


def test_a_cuda_graph_in_the_state_is_refused_unless_allowed() -> None:
    model = nn.Linear(4, 4)
    model.graph = _Graph()  # a module that replays a graph it captured
    address = model.weight.data_ptr()
    with pytest.raises(CheckpointError, match=r"CUDA graphs \(model/graph\).*Nothing was moved"):
        suspend({"model": model}, device="cpu")
    assert model.weight.data_ptr() == address
    suspend({"model": model}, device="cpu", allow_cuda_graphs=True).resume()


@pytest.mark.cuda
def test_a_captured_cuda_graph_is_refused() -> None:
    x = torch.ones(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            y = x * 2
    with pytest.raises(CheckpointError, match="CUDA graphs"):
        suspend({"x": x, "y": y, "graph": graph})


def test_a_tensor_replaced_while_suspended_is_not_brought_back(device: torch.device) -> None:
    model = nn.Linear(64, 64).to(device)
    old_bytes = model.weight.untyped_storage().nbytes()
    s = suspend({"model": model}, device=device)
    model.weight = nn.Parameter(torch.zeros(64, 64, device=device))  # the old Parameter is gone
    gc.collect()
    s.resume()
    assert s.stats.dropped_bytes == old_bytes and s.stats.resumed_bytes == s.stats.bytes - old_bytes
    assert bool((model.weight == 0).all())


def test_data_assigned_while_suspended_stays(device: torch.device) -> None:
    p = nn.Parameter(torch.randn(16, device=device))
    s = suspend({"p": p}, device=device)
    p.data = torch.full((16,), 3.0, device=device)  # the Parameter keeps its identity, not its storage
    s.resume()
    assert bool((p == 3.0).all()) and s.stats.dropped_bytes == 64


def test_a_storage_given_other_memory_while_suspended_is_left_as_the_program_made_it(device: torch.device) -> None:
    t = torch.randn(16, device=device)
    s = suspend({"t": t}, device=device)
    mine = torch.full((16,), 5.0, device=device)
    exchange_all([(t.untyped_storage(), mine.untyped_storage())])  # other code exchanging memory as suspend does
    with pytest.warns(RuntimeWarning, match=r"leaves t as the program made them"):
        s.resume()
    assert s.stats.changed == ("t",) and bool((t == 5.0).all())
    exchange_all([(t.untyped_storage(), mine.untyped_storage())])  # (gives the host copy's pointer back to `mine`)
    del mine


def test_a_dropped_handle_keeps_the_tensors_working(device: torch.device) -> None:
    t = torch.arange(10.0, device=device)
    suspend({"t": t}, device=device)  # the handle is dropped at once: the host bytes must stay
    gc.collect()
    torch.randn(1 << 16, device=device)  # (memory churn)
    assert torch.equal(t, torch.arange(10.0, device=device))
    del t
    gc.collect()
    suspend({}, device=device)  # a later suspend lets go of what nothing uses any more


def test_an_exchange_that_fails_midway_is_undone() -> None:
    a, b = torch.randn(4), torch.randn(4)
    c = torch.randn(4)
    a_ptr, b_ptr, c_ptr = a.data_ptr(), b.data_ptr(), c.data_ptr()
    bad = torch.empty(4, device="meta").untyped_storage()  # another device: torch refuses this exchange
    with pytest.raises(RuntimeError, match="same device"):
        exchange_all([(a.untyped_storage(), b.untyped_storage()), (c.untyped_storage(), bad)])
    assert (a.data_ptr(), b.data_ptr(), c.data_ptr()) == (a_ptr, b_ptr, c_ptr)


def test_a_lazy_resume_inside_inference_mode_runs_eagerly(device: torch.device, caplog) -> None:
    t = torch.randn(8, device=device)
    before = t.clone()
    s = suspend({"t": t}, device=device)
    with torch.inference_mode(), caplog.at_level("WARNING", logger="gpusnap"):
        s.resume(lazy=True)
    assert "runs eagerly" in caplog.text
    assert s.state == "resumed" and s.stats.lazy is False and torch.equal(t, before)


@pytest.mark.cuda
def test_resume_without_room_on_the_device_leaves_the_state_suspended() -> None:
    free = torch.cuda.mem_get_info()[0]
    t = torch.ones(free // 3, dtype=torch.uint8, device="cuda")
    s = suspend({"t": t})
    hog = torch.empty(torch.cuda.mem_get_info()[0] - (32 << 20), dtype=torch.uint8, device="cuda")
    with pytest.raises(CheckpointError, match="stays suspended"):
        s.resume()
    assert s.state == "suspended" and bool(t[:16].eq(1).all())  # still readable, from host memory
    del hog
    s.resume()
    assert bool(t[-16:].eq(1).all())



@pytest.mark.parametrize("blocking", [True, False])
def test_a_saved_cpu_state_stays_the_programs_to_resize_and_suspend(tmp_path, blocking: bool) -> None:
    """A save hashes CPU spans in place; before, through ``Tensor.numpy()``, which marks the
    program's storages not resizable for good: its ``resize_`` failed, and suspend refused
    every tensor as memory "not PyTorch's"."""
    import gpusnap

    t, grows = torch.randn(4096), torch.randn(16)
    with gpusnap.Checkpointer(tmp_path / "ck", config=gpusnap.Config(fsync=False)) as ck:
        ck.save({"t": t, "grows": grows}, blocking=blocking).wait()
    grows.resize_(1 << 16)  # (past its storage: the storage grows)
    before = t.clone()
    s = suspend({"t": t}, device="cpu")
    s.resume()
    assert torch.equal(t, before) and s.stats.bytes == t.nbytes
