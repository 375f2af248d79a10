"""Shared fixtures: the device matrix and skipping of CUDA-only tests on CPU machines."""

from __future__ import annotations

import os

import pytest
import torch
from capture_support import gate  # noqa: F401  (a fixture: chunk stores held until released)

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> torch.device:
    """Every mechanism runs on CPU tensors (CI); on a GPU machine also on CUDA tensors."""
    return torch.device(request.param)


@pytest.fixture(autouse=True, scope="session")
def _memory_tiers(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The default path's memory tiers go to a directory of the test session (a
    Config.memory_tier_dir left empty reads $GPUSNAP_MEMORY_TIER_DIR), not /dev/shm: a test
    that leaves a Checkpointer open leaves no host memory behind."""
    where = tmp_path_factory.mktemp("memory-tiers")
    os.chmod(where, 0o700)
    before = os.environ.get("GPUSNAP_MEMORY_TIER_DIR")
    os.environ["GPUSNAP_MEMORY_TIER_DIR"] = str(where)
    os.environ["GPUSNAP_MEMORY_TIER"] = "off"  # (module fixtures run before _memory_tier: see there)
    yield where
    if before is None:
        os.environ.pop("GPUSNAP_MEMORY_TIER_DIR", None)
    else:
        os.environ["GPUSNAP_MEMORY_TIER_DIR"] = before


@pytest.fixture(autouse=True)
def _memory_tier(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Tests of the default path (marked ``memory_tier``: the README's and docs' code, the
    demo, the memory tier's own tests) run it as a user gets it; the others test the save
    path that writes to the root directly (the memory tier's fallback), as they were written
    for, through ``GPUSNAP_MEMORY_TIER=off``, which a Config that leaves memory_tier empty reads."""
    before = os.environ.pop("GPUSNAP_MEMORY_TIER", None)
    if request.node.get_closest_marker("memory_tier") is None:
        os.environ["GPUSNAP_MEMORY_TIER"] = "off"  # (not the test's monkeypatch: tests undo theirs)
    yield
    os.environ.pop("GPUSNAP_MEMORY_TIER", None)
    if before is not None:
        os.environ["GPUSNAP_MEMORY_TIER"] = before


@pytest.fixture(autouse=True)
def _reader_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``GPUSNAP_TEST_READER_PROCESSES=on`` (or ``off``) runs every restore of the suite with
    (without) reader processes, whatever the test's Config says (CPU restores use threads by
    default; the dedicated tests are in test_restore_reader_procs.py)."""
    mode = os.environ.get("GPUSNAP_TEST_READER_PROCESSES")
    if mode:
        from gpusnap.restore import restorer

        monkeypatch.setattr(restorer, "READER_PROCESSES", mode)
    direct = os.environ.get("GPUSNAP_TEST_DIRECT_COPIES")
    if direct:  # the same for direct-copy helpers (restore/pipeline/sources/direct_copies.py; CPU ones need a forced device check)
        from gpusnap.restore import restorer

        monkeypatch.setattr(restorer, "DIRECT_COPIES", direct)


@pytest.fixture(autouse=True)
def _patient_worker_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reader processes and direct-copy helpers get a minute to say ready, not the 5 s (30 s)
    a restore gives them: on a loaded machine a fresh interpreter may take longer, and a test
    would then see the thread fallback instead of what it checks. Tests of the start timeout
    set their own."""
    from gpusnap.restore.pipeline.sources import direct_copies as direct
    from gpusnap.restore.pipeline.sources import reader_procs as read_procs

    monkeypatch.setattr(read_procs, "START_TIMEOUT_S", 60.0)
    monkeypatch.setattr(direct, "START_TIMEOUT_S", 60.0)
