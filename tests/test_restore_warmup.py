"""restore/pipeline/warmup.py: the device check's hash kernels load on a side thread during set-up;
the copy thread waits for them before its first device check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from faults import HANG_S
from restore_support import add_device_hashes, tiny_config

import gpusnap
from gpusnap.kernels.chunk_hash import chunk_hashes, num_chunks
from gpusnap.kernels.chunk_hash_many import chunk_hashes_many
from gpusnap.restore import restorer as restorer_mod
from gpusnap.restore.pipeline import warmup


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


@pytest.mark.parametrize("lazy", [False, True])
def test_the_copy_thread_waits_for_the_warmup_before_its_first_device_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lazy: bool
) -> None:
    """Forced onto the CPU (device check 'on'): the first stage() comes after join() returned,
    the readers did not wait for it, and the wait is counted."""
    import threading
    import time

    from gpusnap.restore.pipeline.device_check import DeviceCheck

    events: list[str] = []
    release = threading.Event()

    class FakeWarmUp:
        error = None

        def join(self, timeout: float | None = None) -> bool:
            events.append("join")
            assert release.wait(HANG_S), "no reader read while the warm-up loaded"
            time.sleep(0.05)  # a duration kernels_wait_s must include (not an ordering device)
            events.append("joined")
            return True

    monkeypatch.setattr(restorer_mod, "start_kernel_warmup", lambda *a: FakeWarmUp())
    real_stage = DeviceCheck.stage

    def stage(self: DeviceCheck, *args: Any, **kwargs: Any) -> None:
        events.append("stage")
        real_stage(self, *args, **kwargs)

    monkeypatch.setattr(DeviceCheck, "stage", stage)
    from gpusnap.restore.pipeline.sources.host_reads import HostReads

    real_read = HostReads.read_into

    def read_into(self: Any, *args: Any, **kwargs: Any) -> None:
        events.append("read")
        release.set()  # the readers run while the warm-up is still loading
        real_read(self, *args, **kwargs)

    monkeypatch.setattr(HostReads, "read_into", read_into)
    source = {"w": torch.randn(4000), "v": torch.randn(3000)}
    with gpusnap.Checkpointer(tmp_path, config=tiny_config()) as ck:
        ck.save(source, blocking=True).wait()
    _add_hashes(tmp_path)
    with gpusnap.Checkpointer(tmp_path, config=tiny_config(restore_verify_on_device="on")) as ck:
        target = {k: torch.zeros_like(v) for k, v in source.items()}
        handle = ck.restore(target, verify="stream", lazy=lazy)
        handle.wait()
    assert all(torch.equal(target[k], source[k]) for k in source)
    assert handle.stats["device_verified_bytes"] > 0
    assert events.index("read") < events.index("joined") < events.index("stage")
    assert handle.stats["kernels_wait_s"] >= 0.05


def _add_hashes(root: Path) -> None:
    from gpusnap.storage.repository import Repository

    (manifest,) = Repository.open(root).list()
    add_device_hashes(root, manifest.id)
