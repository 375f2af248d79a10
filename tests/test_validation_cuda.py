"""Issue 4 on a GPU: writes the dispatcher never sees (cupy through DLPack, a raw Triton kernel,
a CUDA-graph replay) right after save() are captured correctly or rejected, never committed
wrong; and the Triton chunk hash equals the torch one on the same bytes."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import gpusnap
from gpusnap.kernels.chunk_hash import chunk_hashes

pytestmark = pytest.mark.cuda

TRIALS = 20


def _config(**kw: Any) -> gpusnap.Config:
    # the tracked path (validation's subject) unless a test asks for the whole-state snapshot
    base: dict[str, Any] = dict(chunk_size=1 << 16, pack_size=1 << 24, io_threads=4, fsync=False,
                                copy_piece_bytes=1 << 18, device_snapshot=False)
    base.update(kw)
    return gpusnap.Config(**base)


def _check_trials(tmp_path: Any, write: Any) -> dict[str, int]:
    """``write(t)`` changes ``t`` behind the dispatcher's back right after save(); tracked
    windows and whole-state snapshots alike must never commit it."""
    outcome = {"committed": 0, "rejected": 0, "retried": 0}
    for snapshot in (False, True):
        _trials(tmp_path / f"snapshot-{snapshot}", write, _config(device_snapshot=snapshot), outcome)
    return outcome


def _trials(root: Any, write: Any, config: gpusnap.Config, outcome: dict[str, int]) -> None:
    rng = random.Random(0)
    with gpusnap.Checkpointer(root, config=config, keep_last=2) as ck:
        state = {f"t{i}": torch.randn(rng.choice([1 << 14, 1 << 18, 1 << 20]), device="cuda") for i in range(6)}
        for _ in range(TRIALS):
            expected = {k: v.clone() for k, v in state.items()}
            torch.cuda.synchronize()
            pending = ck.save(state)
            write(state[rng.choice(sorted(state))])
            torch.cuda.synchronize()
            now = {k: v.clone() for k, v in state.items()}
            try:
                info = pending.wait()
            except gpusnap.ValidationError:
                outcome["rejected"] += 1
                continue
            if "a retry" in info.stats["validation"]:
                outcome["retried"] += 1
                expected = now
            else:
                outcome["committed"] += 1
            fresh = {k: torch.zeros_like(v) for k, v in state.items()}
            ck.restore(fresh, info.id)
            for k in state:
                assert torch.equal(fresh[k], expected[k]), f"{k} committed wrong"
            if config.device_snapshot and len(ck.list()) > 1:  # the first window logs reads
                assert not info.stats["tracked"], "a whole-state snapshot needs no tracker"


def test_cupy_writes_are_caught_or_captured(tmp_path: Any) -> None:
    cupy = pytest.importorskip("cupy")

    def write(t: torch.Tensor) -> None:
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            cupy.from_dlpack(t)[:: 97] += 1.0

    _check_trials(tmp_path, write)


def test_raw_triton_writes_are_caught_or_captured(tmp_path: Any) -> None:
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def bump(ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(ptr + offs, tl.load(ptr + offs, mask=mask) + 1.0, mask=mask)

    def write(t: torch.Tensor) -> None:
        bump[(triton.cdiv(t.numel(), 1024),)](t, t.numel(), BLOCK=1024)

    _check_trials(tmp_path, write)


def test_cuda_graph_replays_are_caught_or_captured(tmp_path: Any) -> None:
    graphs: dict[int, Any] = {}

    def write(t: torch.Tensor) -> None:
        g = graphs.get(id(t))
        if g is None:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                t.mul_(1.0)  # warm-up
            torch.cuda.current_stream().wait_stream(s)
            g = graphs[id(t)] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                t.add_(0.5)
        g.replay()

    _check_trials(tmp_path, write)


@pytest.mark.parametrize("nbytes", [16, 1000, (1 << 22) + 12345, 3 << 24])
def test_triton_hash_equals_torch_hash(nbytes: int) -> None:
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    got = chunk_hashes(data, 1 << 20, impl="triton")
    assert torch.equal(got, chunk_hashes(data, 1 << 20, impl="torch"))
    assert torch.equal(got.cpu(), chunk_hashes(data.cpu(), 1 << 20))


def test_own_hash_kernels_are_not_opaque_launches(tmp_path: Any) -> None:
    """Validation and incremental saves launch Triton hash kernels from gpusnap's threads
    while the window is open; they are not the program's launches (each one used to make
    the window protect every buffer)."""
    pytest.importorskip("triton")
    state = {f"t{i}": torch.randn(1 << 20, device="cuda") for i in range(4)}
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config()) as ck:
        ck.save(state).wait()
        state["t0"].add_(1)
        info = ck.save(state).wait()
    assert info.stats["opaque_launches"] == 0
    assert info.stats["bytes_cow"] == 0

