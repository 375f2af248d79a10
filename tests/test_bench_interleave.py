"""benchmarks/concurrent_stall.py --interleave: every config saves once per round, the first
config rotating, so that an A/B of configs is not biased by which one runs first."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "concurrent_stall.py"


@pytest.fixture()
def bench() -> Any:
    # (the script imports transformers only to build a model: not needed here)
    spec = importlib.util.spec_from_file_location("concurrent_stall", _PATH)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


class _Done:
    def __init__(self, tag: str) -> None:
        self.tag = tag

    def wait(self) -> str:
        return self.tag


class _Ck:
    def wait(self) -> None:
        pass


def test_interleaved_saves_rotate_the_first_config(bench: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[tuple[str, str]] = []

    def fake_save(loop: Any, ck: Any, app: Any, where: str, tag: str, every: int, plain_peak: int,
                  profile: bool = False) -> dict[str, Any]:
        key = next(k for k, c in cks.items() if c is ck)
        order.append((key, tag))
        return {"pending": _Done(f"{key}:{tag}"), "step_s": 1.5, "interval_s": 10.0}

    monkeypatch.setattr(bench, "one_save", fake_save)
    cks = {"a": _Ck(), "b": _Ck(), "c": _Ck()}
    out = bench.interleaved_phases(None, cks, {}, "after", 4, 5, 1.0, 0)
    assert [k for k, _ in order] == list("abc" "bca" "cab" "abc")
    assert [t for _, t in order] == ["after0"] * 3 + ["after1"] * 3 + ["after2"] * 3 + ["after3"] * 3
    for key in "abc":  # each config's own saves, in its order, with stalls against the rest median
        assert out[key]["infos"] == [f"{key}:after{s}" for s in range(4)]
        assert out[key]["stalls"] == [0.5] * 4
        assert [r["interval_stall"] for r in out[key]["rows"]] == [5.0] * 4


def test_parse_variant_numbers_repeated_configs(bench: Any) -> None:
    key, cfg, switches = bench.parse_variant("device_snapshot=0,_gather=0", [])
    assert key == "device_snapshot=0,_gather=0" and cfg.device_snapshot is False and switches == {"_gather": 0}
    assert bench.parse_variant("validate=0", ["validate=0"])[0] == "validate=0 #2"
    assert bench.parse_variant("", [])[0] == "gpusnap"
