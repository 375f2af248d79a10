"""A save that comes while the Checkpointer's kernels still load (``capture/warmup.py``):
snapshotted, it does not wait for them at ``save()`` (its snapshot copies through torch, the
copier waits before it hashes); tracked, it hashes at ``save()`` and waits there. Either
way the checkpoint is exact. Each test warms a chunk size no other test uses, so its
warm-up is fresh in this process (a test whose kernels loaded before its save, from a warm
Triton cache, is skipped: it would not show the path it is about).
"""

from __future__ import annotations

import pytest
import torch

import gpusnap
from gpusnap import Config
from gpusnap.capture import warmup

pytestmark = pytest.mark.cuda


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(3)
    return {f"w{i}": torch.randn(1 << 16, device="cuda", generator=g) for i in range(64)}


def _save_at_once(tmp_path, config: Config) -> tuple[dict, dict, dict]:
    app = _state()
    expected = {k: v.clone() for k, v in app.items()}
    with gpusnap.Checkpointer(tmp_path / "ck", config=config) as ck:  # (its warm-up starts here)
        if not warmup.loading(torch.device("cuda", torch.cuda.current_device())):
            pytest.skip("the kernels loaded before the save")
        info = ck.save(app).wait()
        for v in app.values():
            v.add_(1)
        fresh = {k: torch.empty_like(v) for k, v in app.items()}
        ck.restore(fresh, info.id)
    return info.stats, expected, fresh


@pytest.mark.memory_tier  # (the default path: conftest turns the memory tier off for the others)
def test_a_snapshotted_save_during_the_warm_up_waits_for_no_kernel_at_save_and_is_exact(tmp_path):
    stats, expected, fresh = _save_at_once(tmp_path, Config(chunk_size=96 * 1024))
    assert stats["bytes_snapshot"] > 0 and not stats["tracked"]
    assert "open_window.kernels" not in stats["save_phases_s"]  # nothing hashed at save()
    assert all(torch.equal(expected[k], fresh[k]) for k in expected)


def test_a_tracked_save_during_the_warm_up_waits_for_the_kernels_at_save_and_is_exact(tmp_path):
    config = Config(chunk_size=80 * 1024, memory_tier="off", device_snapshot=False, eager_device_bytes=0)
    stats, expected, fresh = _save_at_once(tmp_path, config)
    assert stats["tracked"] and stats["save_phases_s"]["open_window.kernels"] > 0
    assert all(torch.equal(expected[k], fresh[k]) for k in expected)
