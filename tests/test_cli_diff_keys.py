"""``gpusnap diff`` and ``show`` tell keys apart by their decoded keys, not by how they print:
int 0 and str "0", a key "a/b" and a -> b, tuple keys. A change behind a colliding printed
path is never hidden; and ``diff`` says which hash decided "equal"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from restore_support import tiny_config

import gpusnap
from gpusnap.cli.main import main


def _save(root: Path, state: dict[str, Any], tag: str, **kwargs: Any) -> None:
    with gpusnap.Checkpointer(root, config=tiny_config(), **kwargs) as ck:
        ck.save(state, tag=tag, blocking=True).wait()


def _state(changed: float) -> dict[str, Any]:
    return {
        "n": {0: torch.zeros(4), "0": torch.full((4,), changed)},
        "a/b": torch.ones(2),
        "a": {"b": torch.full((2,), changed)},
        "t": {("x", 1): torch.zeros(1), ("x", 2): torch.full((1,), changed)},
        "v": {1: "same " * 10, "1": f"now {changed} " * 10},  # too long for one line: split by key
    }


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    _save(tmp_path, _state(1.0), "c1")
    _save(tmp_path, _state(2.0), "c2")
    return tmp_path


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_diff_matches_entries_by_their_keys(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, ["diff", str(root), "c1", "c2", "--json"])
    assert sorted(doc["changed"]) == sorted(["'n'/'0'", "'a'/'b'", "t/('x', 2)"])
    assert sorted(doc["equal"]) == sorted(["'n'/0", "'a/b'", "t/('x', 1)"])
    assert doc["added"] == doc["removed"] == []
    values = {v["key"]: v["status"] for v in doc["values"]}
    assert values == {"'v'/1": "equal", "'v'/'1'": "changed"}
    assert doc["compared_by"] == "blake2b-128"


def test_show_prints_colliding_paths_apart(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, ["show", str(root), "c2", "--json"])
    keys = [t["key"] for t in doc["tensors"]]
    assert len(keys) == len(set(keys)) == 6
    assert {"'n'/0", "'n'/'0'", "'a/b'", "'a'/'b'", "t/('x', 1)"} <= set(keys)


def test_paths_that_do_not_collide_print_as_before(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = torch.nn.Linear(2, 2)
    _save(tmp_path, {"model": model, "optim": torch.optim.SGD(model.parameters(), momentum=0.9), "step": 1}, "x")
    doc = _json(capsys, ["show", str(tmp_path), "--json"])
    assert [t["key"] for t in doc["tensors"]] == ["model/weight", "model/bias"]


def test_a_fast_tier_diff_says_the_device_hash_decided(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fast = tmp_path / "fast"
    cfg = tiny_config()
    with gpusnap.Checkpointer(tmp_path / "durable", fast_root=fast, fast_keep_last=3, config=cfg) as ck:
        ck.save({"w": torch.zeros(8)}, tag="f1", blocking=True).wait()
        ck.save({"w": torch.ones(8)}, tag="f2", blocking=True).wait()
    doc = _json(capsys, ["diff", str(fast), "f1", "f2", "--json"])
    assert doc["compared_by"] == "nh128" and doc["changed"] == ["w"]
    assert main(["diff", str(fast), "f1", "f2"]) == 0
    assert "nh128 device hashes" in capsys.readouterr().out
