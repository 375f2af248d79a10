"""Adversarial schedules against the concurrent save: the checkpoint equals the state at save().

Every schedule: clone the state, ``pending = ck.save(state)``, mutate at once (in-place ops,
views, ``out=``, ``copy_``, foreach ops, optimizer steps, backward, program errors), then
``pending.wait()``, restore and compare bit for bit with the clones.

To make the races reachable (and some assertions deterministic) a test-only *gate* can hold
the I/O side of a save: the storage backend's chunk stores wait on it, so the copier fills the
staging slots and then blocks with the remaining spans pending. Any wait of the program for a
span (``window.on_program_wait``) opens the gate first, so a wait can never deadlock. The
gate is opened before every gpusnap call that would join the copier (save, wait, restore).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported lazily by the tracker's first op otherwise)
from capture_support import StoreGate
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import gpusnap
from gpusnap.capture.window import on_program_wait

CHUNK = 512
SLOTS = 4
TINY, HUGE, MID = 1, 1 << 30, 3 * 1024
SNAPSHOT = -1  # not a budget: every span copied at save(), the window untracked
BUDGETS = (TINY, HUGE, MID, SNAPSHOT)


def make_config(budget: int) -> gpusnap.Config:
    return gpusnap.Config(
        chunk_size=CHUNK,
        staging_bytes=CHUNK * SLOTS,
        pack_size=1 << 16,
        io_threads=2,
        eager_cpu_bytes=0,
        cpu_snapshot_bytes=HUGE if budget == SNAPSHOT else 0,
        cow_budget_bytes=HUGE if budget == SNAPSHOT else budget,
        fsync=False,
    )


class Gate(StoreGate):
    """Open unless :attr:`gated`; then :meth:`hold` closes it."""

    def __init__(self) -> None:
        super().__init__(held=False)
        self.gated = False

    def hold(self) -> None:
        if self.gated:
            super().hold()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate()
    g.install(monkeypatch)
    with on_program_wait(g.release):  # the program waits for a span: let the copier run
        yield g
    g.release()


@pytest.fixture
def checkpointers(tmp_path: Any, gate: Gate) -> Iterator[dict[int, gpusnap.Checkpointer]]:
    cks = {b: gpusnap.Checkpointer(tmp_path / f"b{b}", config=make_config(b)) for b in BUDGETS}
    yield cks
    gate.release()
    for ck in cks.values():
        ck.close()


# -- state helpers ------------------------------------------------------------------------------
def leaves(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in leaves(v)]
    return []


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).clone().view(torch.uint8)


def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def assert_bits(tensors: list[torch.Tensor], snap: list[torch.Tensor], what: str = "") -> None:
    assert len(tensors) == len(snap)
    for i, (t, s) in enumerate(zip(tensors, snap)):
        assert t.dtype == s.dtype and t.shape == s.shape, (what, i)
        assert torch.equal(raw(t), raw(s)), f"{what}: tensor {i} differs from the state at save()"


def assert_no_tracker() -> None:
    assert _get_current_dispatch_mode_stack() == []


def build_state(rng: random.Random) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Random tensors (several chunks each), a shared storage seen through several views."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    state: dict[str, Any] = {}
    for i in range(rng.randint(2, 5)):
        numel = rng.choice([1, 7, 128, 129, 300, 640, 1500])
        dtype = rng.choice([torch.float32, torch.float32, torch.float64, torch.int64])
        if dtype.is_floating_point:
            t = torch.randn(numel, generator=gen, dtype=dtype)
        else:
            t = torch.randint(-1000, 1000, (numel,), generator=gen)
        if numel % 4 == 0 and rng.random() < 0.5:
            t = t.view(4, -1)
        state[f"t{i}"] = t
    base = torch.randn(1024, generator=gen)  # 4 KiB = 8 chunks, one span
    state["views"] = {
        "head": base[:256],
        "mid": base[200:600],  # overlaps head
        "tail_t": base[600:1000].view(20, 20).t(),
        "bits": base[1000:].view(torch.int32),
    }
    state["scalar"] = torch.tensor(3.25)
    state["empty"] = torch.empty(0)
    targets = leaves(state) + [base]
    return state, targets


def rand_index(rng: random.Random, n: int) -> torch.Tensor:
    return torch.tensor(sorted({rng.randrange(n) for _ in range(rng.randint(1, 4))}))


def mutate(rng: random.Random, t: torch.Tensor) -> None:
    """One random in-place write to ``t`` (or its storage)."""
    floating = t.is_floating_point()
    k = rng.randrange(14)
    if t.numel() == 0 or t.dim() == 0:
        [lambda: t.add_(1), lambda: t.mul_(3), lambda: t.fill_(-9), lambda: t.zero_()][k % 4]()
        return
    n = t.shape[0]
    if k == 0:
        t.add_(0.5 if floating else 3)
    elif k == 1:
        t.mul_(-1.5 if floating else 2)
    elif k == 2:
        t.zero_()
    elif k == 3:
        t.fill_(7)
    elif k == 4:  # slice view
        a = rng.randrange(n)
        t[a : rng.randrange(a, n) + 1].add_(3)
    elif k == 5:  # transpose view
        if t.dim() == 2:
            t.t()[0].fill_(-2)
        else:
            t.unsqueeze(1).transpose(0, 1).mul_(3)
    elif k == 6:  # __setitem__ with an index tensor
        t[rand_index(rng, n)] = 5
    elif k == 7:
        t.index_put_((rand_index(rng, n),), torch.tensor(9, dtype=t.dtype), accumulate=rng.random() < 0.5)
    elif k == 8:
        t.masked_fill_(t > 0, 1)
    elif k == 9:  # out=
        torch.add(torch.ones_like(t), t.clone(), out=t)
    elif k == 10:  # copy_ from another tensor
        t.copy_(torch.arange(t.numel()).reshape(t.shape).to(t.dtype))
    elif k == 11:
        t[rng.randrange(n)] = -1  # scalar setitem: select + fill_/copy_
    elif k == 12:
        if floating:
            t.uniform_()
        else:
            t.neg_()
    else:  # a read, then a write of a strided view
        _ = t.sum()
        t[::2].sub_(1)


def program_error(rng: random.Random, t: torch.Tensor) -> None:
    """An op that fails (shape error) inside the window; the program catches it."""
    with pytest.raises(RuntimeError):
        if rng.random() < 0.5:
            t.add_(torch.ones(t.numel() + 2, 3))
        else:
            torch.mm(torch.ones(2, 3), torch.ones(4, 5), out=torch.empty(2, 5))


def random_ops(rng: random.Random, targets: list[torch.Tensor], count: int) -> None:
    for _ in range(count):
        r = rng.random()
        if r < 0.12:  # foreach over a same-dtype subset
            dtype = rng.choice(targets).dtype
            group = [t for t in targets if t.dtype == dtype and rng.random() < 0.6]
            if group:
                torch._foreach_add_(group, 1)
        elif r < 0.2:
            program_error(rng, rng.choice(targets))
        else:
            mutate(rng, rng.choice(targets))


def save(ck: gpusnap.Checkpointer, gate: Gate, state: dict[str, Any]) -> Any:
    gate.release()  # save() joins the previous copier
    pending = ck.save(state)
    gate.hold()
    return pending


def finish(pending: Any, gate: Gate, *, last: bool = True) -> Any:
    gate.release()
    info = pending.wait()
    if last:  # an earlier save's wait() leaves a later, still open, window's tracker in place
        assert_no_tracker()
    return info


# -- randomized schedules -----------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(8))
def test_random_mutations_right_after_save(checkpointers: dict[int, gpusnap.Checkpointer], gate: Gate, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        ck = checkpointers[rng.choice(BUDGETS)]
        gate.gated = rng.random() < 0.5
        state, targets = build_state(rng)
        tensors = leaves(state)
        before = snapshot(tensors)
        pending = save(ck, gate, state)
        random_ops(rng, targets, rng.randint(1, 8))
        info = finish(pending, gate)
        random_ops(rng, targets, 2)  # after the window: no effect on the checkpoint
        ck.restore(state, info.id)
        assert_no_tracker()
        assert_bits(tensors, before, f"seed {seed}")


@pytest.mark.parametrize("seed", range(4))
def test_back_to_back_saves(checkpointers: dict[int, gpusnap.Checkpointer], gate: Gate, seed: int) -> None:
    rng = random.Random(1000 + seed)
    for _ in range(12):
        ck = checkpointers[rng.choice(BUDGETS)]
        gate.gated = rng.random() < 0.5
        state, targets = build_state(rng)
        tensors = leaves(state)
        saves = []
        for _ in range(rng.randint(2, 4)):
            before = snapshot(tensors)
            saves.append((save(ck, gate, state), before))
            random_ops(rng, targets, rng.randint(1, 5))
        gate.release()
        infos = [(finish(p, gate, last=False), before) for p, before in saves]
        assert_no_tracker()
        for info, before in rng.sample(infos, len(infos)):
            ck.restore(state, info.id)
            assert_bits(tensors, before, f"seed {seed} checkpoint {info.id}")


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer | None:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "adamw-foreach":
        return torch.optim.AdamW(params, lr=0.05, foreach=True)
    if kind == "adamw-single":
        return torch.optim.AdamW(params, lr=0.05, foreach=False)
    return None  # backward only: .grad accumulates in place


def optim_tensors(model: nn.Module, opt: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    out = list(model.parameters()) + [p.grad for p in model.parameters()]
    if opt is not None:
        for _, st in sorted(opt.state_dict()["state"].items()):
            out += [v for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize("kind", ["sgd", "adamw-foreach", "adamw-single", "backward"])
@pytest.mark.parametrize("seed", range(2))
def test_training_step_right_after_save(
    checkpointers: dict[int, gpusnap.Checkpointer], gate: Gate, kind: str, seed: int
) -> None:
    rng = random.Random(2000 + seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 8))
    opt = make_optimizer(kind, model.parameters())
    x = torch.randn(32, 16)

    def step() -> None:
        if opt is not None:
            opt.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        if opt is not None:
            opt.step()

    step()  # grads and optimizer state exist before the first save
    state: dict[str, Any] = {"model": model, "grads": [p.grad for p in model.parameters()]}
    if opt is not None:
        state["optim"] = opt
    for _ in range(8):
        ck = checkpointers[rng.choice(BUDGETS)]
        gate.gated = rng.random() < 0.5
        before = snapshot(optim_tensors(model, opt))
        pending = save(ck, gate, state)
        for _ in range(rng.randint(1, 3)):
            step()
        if rng.random() < 0.3:
            program_error(rng, next(model.parameters()))
            step()
        info = finish(pending, gate)
        ck.restore(state, info.id)
        assert_bits(optim_tensors(model, opt), before, kind)


# -- deterministic races: the copier is held, so the mutated span is certainly pending ------------
def held_state() -> dict[str, torch.Tensor]:
    # "a" (16 chunks) is copied first and outlasts the staging slots; "y", "z" stay pending.
    return {"a": torch.randn(2048), "y": torch.randn(1024), "z": torch.randn(1024)}


def run_held(tmp_path: Any, gate: Gate, budget: int, mutate_keys: list[str]) -> dict[str, Any]:
    with gpusnap.Checkpointer(tmp_path / "held", config=make_config(budget)) as ck:
        state = held_state()
        tensors = leaves(state)
        before = snapshot(tensors)
        gate.gated = True
        gate.hold()  # before save(): the copier must stall with "a" in flight, every time
        pending = ck.save(state)
        for key in mutate_keys:
            state[key].mul_(-2).add_(1)
        info = finish(pending, gate)
        ck.restore(state, info.id)
        assert_bits(tensors, before, f"budget {budget}")
        return info.stats


def test_large_budget_copies_on_write(tmp_path: Any, gate: Gate) -> None:
    stats = run_held(tmp_path, gate, HUGE, ["z"])
    assert stats["bytes_cow"] == 4096 and stats["cow_events"] == 1 and stats["waits"] == 0


def test_tiny_budget_waits(tmp_path: Any, gate: Gate) -> None:
    stats = run_held(tmp_path, gate, TINY, ["z"])
    assert stats["waits"] >= 1 and stats["bytes_cow"] == 0


def test_budget_in_between_shadows_then_waits(tmp_path: Any, gate: Gate) -> None:
    stats = run_held(tmp_path, gate, 5000, ["z", "y"])
    assert stats["cow_events"] == 1 and stats["bytes_cow"] == 4096 and stats["waits"] >= 1


def test_tracker_leaves_at_next_gpusnap_call(tmp_path: Any, gate: Gate) -> None:
    with gpusnap.Checkpointer(tmp_path / "r", config=make_config(HUGE)) as ck:
        state = held_state()
        before = snapshot(leaves(state))
        pending = ck.save(state)
        assert len(_get_current_dispatch_mode_stack()) == 1
        state["z"].add_(1)
        pending.wait_staged()  # a gpusnap call on this thread: pops the closed window's tracker
        assert_no_tracker()
        info = pending.wait()
        assert_no_tracker()
        pending2 = ck.save(state)
        while not pending2.done():  # no gpusnap call: the tracker may stay, passing ops through
            state["y"].add_(1)
        ck.wait()
        assert_no_tracker()
        ck.restore(state, info.id)
        assert_bits(leaves(state), before)
