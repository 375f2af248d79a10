"""Helpers for the tests of the benchmark scripts."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any


def load_benchmark(name: str) -> Any:
    """``benchmarks/<name>.py`` as a module (the benchmarks are scripts, not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
