"""Suspend and resume in place (issue 41): the bytes leave the device and come back into the
same tensor objects, bit for bit, whatever the dtype, layout, sharing or owner.

Every test runs on CPU tensors (``device="cpu"``: the same mechanism over host memory) and,
on a GPU machine, on CUDA tensors too (the ``device`` fixture).
"""

from __future__ import annotations

import torch
from torch import nn

from gpusnap.moving import SuspendStats, Suspended, release_host_memory, suspend

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
    *[getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32") if hasattr(torch, n)],
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (NaN payloads and negative zeros compare as what they are)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8).clone().cpu()


def _random(dtype: torch.dtype, shape: tuple[int, ...], device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return (torch.randint(0, 2, shape, generator=g) == 1).to(device)
    nbytes = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * nbytes), dtype=torch.uint8, generator=g)
    return raw.view(dtype).to(device)  # every bit pattern: NaNs, infinities, subnormals


def _snapshot(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: _bits(v) for k, v in state.items()}


def _same(state: dict[str, torch.Tensor], snapshot: dict[str, torch.Tensor]) -> None:
    for key, t in state.items():
        assert torch.equal(_bits(t), snapshot[key]), key


def test_every_dtype_round_trips_bit_exactly(device: torch.device) -> None:
    state = {str(dtype): _random(dtype, (3, 5), device, i) for i, dtype in enumerate(DTYPES)}
    before = _snapshot(state)
    objects = dict(state)
    s = suspend(state, device=device)
    assert s.state == "suspended"
    assert s.stats.storages == len(DTYPES) and s.stats.tensors == len(DTYPES)
    assert s.stats.bytes == sum(t.untyped_storage().nbytes() for t in state.values())
    _same(state, before)  # a suspended tensor still reads its bytes (from host memory)
    s.resume()
    assert s.state == "resumed" and s.done()
    assert all(state[k] is objects[k] for k in state)
    assert all(t.device.type == device.type for t in state.values())
    _same(state, before)


def test_suspend_frees_the_device_memory_and_resume_takes_it_again(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
    big = torch.ones(64 << 20 if device.type == "cuda" else 1 << 20, dtype=torch.uint8, device=device)
    address = big.data_ptr()
    s = suspend({"big": big}, device=device)
    assert big.data_ptr() != address  # the storage points at its host copy now
    assert s.stats.device_freed_bytes >= 0.95 * big.nbytes
    if device.type == "cuda":
        assert s.stats.pinned and s.stats.allocator_released_bytes >= big.nbytes
    s.resume()
    assert big.device.type == device.type and bool((big == 1).all())
    assert s.stats.resumed_bytes == big.nbytes and s.stats.resume_s is not None and s.stats.lazy is False


def test_a_second_suspend_frees_as_much_though_the_program_allocated_meanwhile(device: torch.device) -> None:
    # Resumed storages live in a pool of their own: tensors made after a resume cannot share
    # their segments, so the next suspend gives all of them back (round 2 used to keep some).
    if device.type == "cuda":
        torch.cuda.empty_cache()
    sizes = [3 << 20, 5 << 20, 600 << 10, 12 << 20, 100 << 10]  # 1-10 MiB ones share 20 MiB segments
    state = {f"t{i}": torch.full((n,), i + 1, dtype=torch.uint8, device=device) for i, n in enumerate(sizes)}
    suspend(state, device=device).resume()
    kept = [torch.zeros(n // 3, dtype=torch.uint8, device=device) for n in sizes]  # the program's, made since
    s = suspend(state, device=device)
    assert s.stats.device_freed_bytes >= 0.95 * s.stats.bytes
    s.resume()
    assert all(bool((t == i + 1).all()) for i, t in enumerate(state.values()))
    assert all(bool((k == 0).all()) for k in kept)


def test_views_and_non_contiguous_tensors_keep_viewing(device: torch.device) -> None:
    base = torch.arange(48, dtype=torch.float32, device=device).reshape(6, 8)
    inside = {"base": base, "strided": base[1:, ::3], "transposed": base.T, "strided_as": base.as_strided((3, 3), (9, 2), 5)}
    outside = base[2]  # a view the state does not list: its storage is the same one
    before = _snapshot(inside)
    s = suspend(inside, device=device)
    assert s.stats.storages == 1 and s.stats.tensors == 4
    s.resume()
    _same(inside, before)
    base.mul_(-1)  # every view, listed or not, still views the one storage
    assert torch.equal(inside["strided"], -torch.arange(48, dtype=torch.float32, device=device).reshape(6, 8)[1:, ::3])
    assert torch.equal(outside, base[2]) and outside.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def _tied(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 6), nn.Linear(6, 10, bias=False)).to(device)
    model[2].weight = model[0].weight  # tied input and output embeddings
    model.register_buffer("table", torch.randn(4, device=device))
    model.register_buffer("scratch", torch.randn(3, device=device), persistent=False)  # not in state_dict()
    model.extra = torch.randn(2, device=device)  # a plain attribute, no buffer
    return model


def test_modules_keep_their_parameters_buffers_and_ties(device: torch.device) -> None:
    model = _tied(device)
    params = dict(model.named_parameters())
    reached = {"emb": model[0].weight, "table": model.table, "scratch": model.scratch, "extra": model.extra}
    before = _snapshot(reached)
    s = suspend({"model": model}, device=device)
    # the tied weight once; both Linear biases/weights, the buffers, the attribute
    assert s.stats.storages == 1 + 1 + 1 + 2 + 1
    s.resume()
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    assert model[2].weight is model[0].weight
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in model.parameters())
    _same(reached, before)


def test_gradients_are_suspended_and_kept(device: torch.device) -> None:
    model = _tied(device)
    model(torch.tensor([[1, 2, 3]], device=device)).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    before = {n: _bits(g) for n, g in grads.items()}
    s = suspend({"model": model}, device=device)
    assert s.stats.storages == 6 + 3  # the three parameters' gradients too
    s.resume()
    for n, p in model.named_parameters():
        assert p.grad is grads[n] and torch.equal(_bits(p.grad), before[n])


def _trained(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def _step(model: nn.Module, optim: torch.optim.Optimizer, seed: int, device: torch.device) -> None:
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed)).to(device)
    optim.zero_grad()
    model(x).square().mean().backward()
    optim.step()


def test_an_optimizer_step_after_resume_equals_one_never_suspended(device: torch.device) -> None:
    a, a_optim = _trained(device)
    b, b_optim = _trained(device)
    for model, optim in ((a, a_optim), (b, b_optim)):
        _step(model, optim, 0, device)
    s = suspend({"model": a, "optim": a_optim}, device=device)
    assert s.stats.storages == 4 + 4 + 4 + 4 + (4 if device.type == "cpu" else 0)  # params, grads, moments, steps
    s.resume()
    for model, optim in ((a, a_optim), (b, b_optim)):
        _step(model, optim, 1, device)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(_bits(pa), _bits(pb))
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(_bits(a_optim.state[pa][key]), _bits(b_optim.state[pb][key]))


def test_nested_containers_and_plain_objects_are_reached(device: torch.device) -> None:
    class Holder:
        def __init__(self) -> None:
            self.kv = [torch.randn(2, 3, device=device), torch.randn(2, 3, device=device)]

    class Slotted:
        __slots__ = ("t",)

        def __init__(self) -> None:
            self.t = torch.randn(4, device=device)

    holder, slotted = Holder(), Slotted()
    loop: list[object] = []
    loop.append(loop)  # a cycle is walked once
    state = {"nested": {"a": [torch.randn(3, device=device), (torch.randn(2, device=device),)]},
             "holder": holder, "slotted": slotted, "loop": loop, "n": 3, "name": "x"}
    tensors = {"a0": state["nested"]["a"][0], "a1": state["nested"]["a"][1][0], "kv0": holder.kv[0],
               "kv1": holder.kv[1], "slot": slotted.t}
    before = _snapshot(tensors)
    s = suspend(state, device=device)
    assert s.stats.storages == 5
    s.resume()
    _same(tensors, before)
    assert state["n"] == 3 and state["name"] == "x"


def test_writes_while_suspended_are_what_comes_back(device: torch.device) -> None:
    model, optim = _trained(device)
    _step(model, optim, 0, device)
    s = suspend({"model": model, "optim": optim}, device=device)
    _step(model, optim, 1, device)  # a whole step on suspended state (slowly, from host memory)
    expected = {n: _bits(p) for n, p in model.named_parameters()}
    s.resume()
    for n, p in model.named_parameters():
        assert torch.equal(_bits(p), expected[n])


def test_context_manager_resumes_on_exit(device: torch.device) -> None:
    t = torch.randn(7, device=device)
    before = _bits(t)
    with suspend({"t": t}, device=device) as s:
        assert isinstance(s, Suspended) and s.state == "suspended"
    assert s.state == "resumed" and torch.equal(_bits(t), before)


def test_tensors_of_other_devices_stay_where_they_are() -> None:
    cpu = torch.randn(4)
    address = cpu.data_ptr()
    s = suspend({"cpu": cpu}, device="cuda")  # (a CUDA suspend moves CUDA tensors only)
    assert s.stats == SuspendStats(bytes=0, storages=0, tensors=0, suspend_s=s.stats.suspend_s, host_alloc_s=0.0,
                                   host_reused=False, pinned=False, device_freed_bytes=0, allocator_released_bytes=0)
    assert cpu.data_ptr() == address
    s.resume()
    assert s.state == "resumed"


def test_host_memory_is_kept_for_the_next_suspend_until_released(device: torch.device) -> None:
    release_host_memory()
    t = torch.randn(1000, device=device)
    first = suspend({"t": t}, device=device)
    first.resume()
    second = suspend({"t": t}, device=device)
    assert not first.stats.host_reused and second.stats.host_reused and second.stats.host_alloc_s == 0.0
    second.resume()
    assert release_host_memory() >= t.nbytes
    third = suspend({"t": t}, device=device, reuse_host_memory=False)
    third.resume()
    assert not third.stats.host_reused and release_host_memory() == 0


def test_a_compiled_model_runs_after_resume_without_recompiling(device: torch.device) -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model, _ = _trained(device)
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(3, 8, device=device)
    expected = compiled(x)
    frames = counters["stats"]["unique_graphs"]
    s = suspend({"model": compiled}, device=device)
    assert s.stats.storages == 4  # the compiled wrapper's module is walked
    s.resume()
    assert torch.equal(compiled(x), expected)
    assert counters["stats"]["unique_graphs"] == frames  # no recompilation
    torch._dynamo.reset()


def test_a_checkpoint_of_a_suspended_state_holds_its_bytes(tmp_path, device: torch.device) -> None:
    import gpusnap

    model, optim = _trained(device)
    _step(model, optim, 0, device)
    expected = {n: _bits(p) for n, p in model.named_parameters()}
    s = suspend({"model": model}, device=device)
    with gpusnap.Checkpointer(tmp_path / "ck") as ck:
        ck.save({"model": model}, blocking=True)
        s.resume()
        fresh, _ = _trained(device)
        ck.restore({"model": fresh})
    for n, p in fresh.named_parameters():
        assert torch.equal(_bits(p), expected[n])
