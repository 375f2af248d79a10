"""restore/warmup.py: the device check's hash kernels load on a side thread during set-up;
the copy thread waits for them before its first device check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from restore_support import tiny_config

import gpusnap
from gpusnap.kernels.chunk_hash import chunk_hashes, num_chunks
from gpusnap.kernels.chunk_hash_many import chunk_hashes_many
from gpusnap.restore import restorer as restorer_mod
from gpusnap.restore import warmup


def test_nothing_to_warm_without_cuda_targets() -> None:
    assert warmup.start_kernel_warmup([torch.device("cpu")], 512, lambda d: None) is None
    assert warmup.start_kernel_warmup([], 512, lambda d: None) is None


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warmup, "WARM_KERNELS", False)
    assert warmup.start_kernel_warmup([torch.device("cuda", 0)], 512, lambda d: None) is None


@pytest.mark.parametrize("verify", ["stream", "off"])
def test_a_restore_warms_only_when_it_may_check_on_the_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             verify: str) -> None:
    calls: list[tuple[set[torch.device], int]] = []

    def spy(devices: Any, chunk_size: int, stream_of: Any) -> None:
        calls.append((set(devices), chunk_size))

    monkeypatch.setattr(restorer_mod, "start_kernel_warmup", spy)
    state = {"w": torch.randn(4000)}
    with gpusnap.Checkpointer(tmp_path, config=tiny_config()) as ck:
        ck.save(state, blocking=True).wait()
        ck.restore(state, verify=verify)  # type: ignore[arg-type]
    # CPU targets: asked with no CUDA device (nothing to warm); never when nothing is checked
    assert calls == ([(set(), 512)] if verify == "stream" else [])


@pytest.mark.cuda
def test_warmup_runs_both_hash_paths_and_leaves_them_correct() -> None:
    dev = torch.device("cuda", 0)
    stream = torch.cuda.Stream(dev)
    chunk = 4096 + 512  # a chunk size no other test warms
    warm = warmup.start_kernel_warmup([dev], chunk, lambda d: stream)
    assert warm is not None and warm.join(timeout=300)
    assert warm.error is None
    assert warmup.start_kernel_warmup([dev], chunk, lambda d: stream) is None, "warmed once per process"
    data = torch.randint(0, 255, (3 * chunk + 5,), dtype=torch.uint8)
    assert torch.equal(chunk_hashes(data.cuda(), chunk).cpu(), chunk_hashes(data, chunk, impl="torch"))
    spans = [data[: chunk + 16], data[chunk + 16 :]]
    out = torch.empty((sum(num_chunks(s.numel(), chunk) for s in spans), 2), dtype=torch.int64, device=dev)
    chunk_hashes_many([s.cuda() for s in spans], chunk, out)
    assert torch.equal(out.cpu(), torch.cat([chunk_hashes(s, chunk, impl="torch") for s in spans]))
