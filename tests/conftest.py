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
