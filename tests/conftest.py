"""Shared fixtures: the device matrix and skipping of CUDA-only tests on CPU machines."""

from __future__ import annotations

import pytest
import torch

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
