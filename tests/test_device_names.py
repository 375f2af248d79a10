"""A direct save that compares with the previous checkpoint stores the changed chunks of CUDA
spans under their device hashes (``nh:`` names, storage/chunk_names.py): the host hashes none
of those bytes. The names still check the bytes: a flipped bit fails the restore. CPU spans
keep BLAKE2b names (their hash costs the host as much either way)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from restore_support import corrupt_chunk

import gpusnap
from gpusnap.storage.chunk_names import is_device_name
from gpusnap.storage.repository import Repository

CHUNK = 4096


def _config() -> gpusnap.Config:
    return gpusnap.Config(chunk_size=CHUNK, memory_tier="off", io_threads=2, fsync=False)


def _names(root: Path, checkpoint_id: str) -> list[str]:
    return [c for e in Repository.open(root).load_manifest(checkpoint_id).storages for c in e.chunks]


def _two_saves(root: Path, device: torch.device) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(16 * CHUNK // 4, generator=g).to(device), "b": torch.randn(8, generator=g).to(device)}
    with gpusnap.Checkpointer(root, config=_config()) as ck:
        first = ck.save(state, blocking=True).wait()
        state["w"][5] = 42.0  # one chunk changes: the second save compares, and stores only it
        second = ck.save(state, blocking=True).wait()
    return state, _names(root, first.id), _names(root, second.id)


def test_cpu_spans_keep_blake2b_names(tmp_path: Path) -> None:
    _state, first, second = _two_saves(tmp_path / "ck", torch.device("cpu"))
    assert not any(is_device_name(n) for n in first + second)


@pytest.mark.cuda
def test_changed_cuda_chunks_are_stored_by_device_hash_and_still_checked(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    state, first, second = _two_saves(root, torch.device("cuda"))
    assert not any(is_device_name(n) for n in first), "the first save compares with nothing"
    changed = [b for a, b in zip(first, second) if a != b]
    assert changed and all(is_device_name(n) for n in changed)
    expected = {k: v.clone() for k, v in state.items()}
    fresh = {k: torch.zeros_like(v) for k, v in state.items()}
    with gpusnap.Checkpointer(root, config=_config()) as ck:
        ck.restore(fresh, verify="upfront").wait()
        assert all(torch.equal(fresh[k], expected[k]) for k in state)
        corrupt_chunk(root, torch.tensor([42.0]).numpy().tobytes(), 0)  # the changed chunk's bytes
        with pytest.raises(gpusnap.IntegrityError):
            ck.restore({k: torch.zeros_like(v) for k, v in state.items()}, verify="upfront").wait()
