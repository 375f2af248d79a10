"""restore/warmup.py: the device check's hash kernels load on a side thread during set-up."""

from __future__ import annotations

import pytest
import torch

from gpusnap.kernels.chunk_hash import chunk_hashes
from gpusnap.restore import warmup


def test_nothing_to_warm_without_cuda_targets() -> None:
    assert warmup.start_kernel_warmup([torch.device("cpu")], 512) is None
    assert warmup.start_kernel_warmup([], 512) is None


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warmup, "WARM_KERNELS", False)
    assert warmup.start_kernel_warmup([torch.device("cuda", 0)], 512) is None


@pytest.mark.cuda
def test_warmup_runs_both_hash_paths_and_leaves_them_correct() -> None:
    thread = warmup.start_kernel_warmup([torch.device("cuda", 0)], 4096)
    assert thread is not None
    thread.join(timeout=300)
    assert not thread.is_alive()
    data = torch.randint(0, 255, (3 * 4096 + 5,), dtype=torch.uint8)
    got = chunk_hashes(data.cuda(), 4096).cpu()
    assert torch.equal(got, chunk_hashes(data, 4096, impl="torch"))
