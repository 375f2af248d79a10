"""``gpusnap diff`` and ``gpusnap du`` (checkpoint roots and fast roots), and ``--json`` on
every command that reads checkpoints. CPU only, deterministic: chunk boundaries are chosen so
that every expected byte count is a whole number of chunks."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import gpusnap
from gpusnap import Config
from gpusnap.cli.main import main
from gpusnap.storage.backend import LocalBackend
from gpusnap.storage.fast_tier import chunk_location
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.pack import read_pack_index

CHUNK = 64 * 1024
CFG = Config(chunk_size=CHUNK, copy_piece_bytes=4 * CHUNK, fast_slab_bytes=2 << 20)
FLOATS = CHUNK // 4  # float32 elements in one chunk


def _states() -> list[dict[str, Any]]:
    """Three app_states: ``frozen`` (8 chunks) never changes; ``moving`` (1 chunk) changes each
    time and is gone from the third; ``half`` (2 chunks) changes its second chunk once, in the
    second; ``extra`` (1 chunk) appears in the third; ``step`` is a plain value."""
    g = torch.Generator().manual_seed(0)
    frozen = torch.randn(8 * FLOATS, generator=g)
    moving = torch.randn(FLOATS, generator=g)
    half = torch.randn(2 * FLOATS, generator=g)
    first = {"frozen": frozen, "moving": moving.clone(), "half": half.clone(), "step": 1}
    half[FLOATS:] += 1
    second = {"frozen": frozen, "moving": moving + 1, "half": half.clone(), "step": 2}
    third = {"frozen": frozen, "half": half.clone(), "extra": torch.randn(FLOATS, generator=g), "step": 3}
    return [first, second, third]


def _save_all(root: Path, **kwargs: Any) -> list[str]:
    ids = []
    for i, state in enumerate(_states()):
        with gpusnap.Checkpointer(root, config=CFG, **kwargs) as ck:
            ids.append(ck.save(state, tag=f"c{i + 1}", blocking=True).wait().id)
    return ids


@pytest.fixture(scope="module")
def durable(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("diffdu") / "ck"
    return root, _save_all(root)


@pytest.fixture(scope="module")
def fast(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    base = tmp_path_factory.mktemp("diffdu_fast")
    root = base / "fast"
    ids = _save_all(base / "durable", fast_root=root, fast_keep_last=3, promote_every=1000)
    return root, ids


def _json(capsys: pytest.CaptureFixture[str], argv: list[str], code: int = 0) -> dict[str, Any]:
    assert main(argv) == code
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("which", ["durable", "fast"])
def test_diff_lists_changed_equal_added_removed(which, request, capsys) -> None:
    root, ids = request.getfixturevalue(which)
    doc = _json(capsys, ["diff", str(root), ids[0], "c2", "--json"])
    assert doc["schema"] == "gpusnap.diff/1"
    assert (doc["a"]["id"], doc["b"]["id"]) == (ids[0], ids[1])
    assert doc["changed"] == ["moving", "half"]
    assert doc["equal"] == ["frozen"]
    assert doc["added"] == doc["removed"] == []
    by_key = {t["key"]: t for t in doc["tensors"]}
    assert by_key["half"]["changed_bytes"] == CHUNK  # only its second chunk differs
    assert by_key["moving"]["changed_bytes"] == CHUNK
    assert by_key["frozen"]["changed_bytes"] == 0
    assert doc["bytes"] == {
        "shared": 9 * CHUNK, "shared_chunks": 9,  # frozen, and half's first chunk
        "a_only": 2 * CHUNK, "a_only_chunks": 2,
        "b_only": 2 * CHUNK, "b_only_chunks": 2,
    }
    assert doc["values"] == [{"key": "step", "status": "changed"}]

    doc = _json(capsys, ["diff", str(root), "c2", "c3", "--json"])
    assert doc["equal"] == ["frozen", "half"]
    assert doc["removed"] == ["moving"] and doc["added"] == ["extra"] and doc["changed"] == []
    assert doc["bytes"]["shared"] == 10 * CHUNK
    assert (doc["bytes"]["a_only"], doc["bytes"]["b_only"]) == (CHUNK, CHUNK)


def test_diff_of_a_checkpoint_with_itself_is_all_equal(durable, capsys) -> None:
    root, ids = durable
    doc = _json(capsys, ["diff", str(root), ids[1], ids[1], "--json"])
    assert doc["changed"] == doc["added"] == doc["removed"] == []
    assert doc["bytes"]["a_only"] == doc["bytes"]["b_only"] == 0


def test_diff_text_lists_what_differs(durable, capsys) -> None:
    root, _ = durable
    assert main(["diff", str(root), "c2", "c3"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()]
    assert "tensors: 0 changed, 1 added, 1 removed, 2 equal" in out
    assert any(r[:2] == ["added", "extra"] for r in rows)
    assert any(r[:2] == ["removed", "moving"] for r in rows)
    assert not any(r[:2] == ["equal", "frozen"] for r in rows)  # equal ones with --all only
    assert main(["diff", str(root), "c2", "c3", "--all"]) == 0
    assert any(r[:2] == ["equal", "frozen"] for r in (line.split() for line in capsys.readouterr().out.splitlines()))


def _pack_totals(root: Path) -> tuple[int, int]:
    """(file bytes, chunk bytes) of every pack under ``root``, read independently of du."""
    backend = LocalBackend(root)
    files = chunks = 0
    for fan in os.listdir(root / "packs"):
        for name in os.listdir(root / "packs" / fan):
            index = read_pack_index(backend, f"packs/{fan}/{name}")
            files += index.size
            chunks += sum(n for _, _, n in index.entries)
    return files, chunks


def test_du_unique_and_shared_add_up_to_the_packs(durable, capsys) -> None:
    root, ids = durable
    doc = _json(capsys, ["du", str(root), "--json"])
    assert doc["schema"] == "gpusnap.du/1" and doc["tier"] == "durable"
    rows = [(c["id"], c["unique_bytes"] // CHUNK, c["shared_bytes"] // CHUNK) for c in doc["checkpoints"]]
    assert rows == [(ids[0], 2, 9), (ids[1], 1, 10), (ids[2], 1, 10)]
    assert [c["logical_bytes"] for c in doc["checkpoints"]] == [11 * CHUNK, 11 * CHUNK, 11 * CHUNK]
    total = doc["total"]
    on_disk, stored = _pack_totals(root)
    assert total["unique_bytes"] + total["shared_bytes"] == total["referenced_bytes"] == 14 * CHUNK
    assert total["referenced_bytes"] == stored == total["stored_bytes"]  # nothing dead, nothing missing
    assert total["on_disk_bytes"] == on_disk
    assert total["dead_bytes"] == total["missing_bytes"] == 0
    assert total["logical_bytes"] == 33 * CHUNK


def test_du_counts_dead_bytes_after_gc(tmp_path, capsys) -> None:
    root = tmp_path / "ck"
    _save_all(root)
    assert main(["gc", str(root), "--keep-last", "1"]) == 0
    capsys.readouterr()
    doc = _json(capsys, ["du", str(root), "--json"])
    (only,) = doc["checkpoints"]
    assert (only["unique_bytes"], only["shared_bytes"]) == (11 * CHUNK, 0)
    on_disk, stored = _pack_totals(root)
    total = doc["total"]
    assert total["stored_bytes"] == stored and total["on_disk_bytes"] == on_disk
    assert total["referenced_bytes"] + total["dead_bytes"] == stored


def test_du_of_a_fast_root_counts_slab_ranges(fast, capsys) -> None:
    root, ids = fast
    doc = _json(capsys, ["du", str(root), "--json"])
    assert doc["tier"] == "fast"
    rows = [(c["id"], c["unique_bytes"] // CHUNK, c["shared_bytes"] // CHUNK) for c in doc["checkpoints"]]
    assert rows == [(ids[0], 2, 9), (ids[1], 1, 10), (ids[2], 1, 10)]
    used: dict[int, set[int]] = {}
    for path in (root / "manifests").glob("*.json"):
        for storage in Manifest.from_json(path.read_bytes(), str(path)).storages:  # (either format version)
            for name in storage.chunks:
                _h, slab, off, n = chunk_location(name)
                used.setdefault(slab, set()).update(range(off, off + n))
    total = doc["total"]
    assert total["referenced_bytes"] == sum(len(b) for b in used.values()) == 14 * CHUNK
    slabs = sum(p.stat().st_size for p in (root / "slabs").glob("*.slab"))
    assert total["on_disk_bytes"] == slabs
    assert total["dead_bytes"] == slabs - total["referenced_bytes"]  # free slab bytes


def test_du_text(durable, capsys) -> None:
    root, ids = durable
    assert main(["du", str(root)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()]
    assert rows[0] == ["ID", "TAG", "CREATED", "SIZE", "UNIQUE", "SHARED"]
    assert [r[0] for r in rows[1:4]] == ids
    assert "on disk:" in out and "3 checkpoint(s)" in out


@pytest.mark.parametrize("argv", [["diff", "{root}", "nope", "c1"], ["diff", "{root}", "c1", "nope"],
                                  ["show", "{root}", "nope"], ["verify", "{root}", "nope"]])
def test_unknown_checkpoint_is_one_line_and_exit_2(durable, capsys, argv) -> None:
    root, _ = durable
    assert main([a.format(root=root) for a in argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpusnap: error: ") and "nope" in lines[0]


@pytest.mark.parametrize("command", ["diff", "du"])
def test_missing_root_is_exit_2(tmp_path, capsys, command) -> None:
    argv = [command, str(tmp_path / "none")] + (["a", "b"] if command == "diff" else [])
    assert main(argv) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1


def test_diff_of_an_unreadable_checkpoint_is_damage(tmp_path, capsys) -> None:
    root = tmp_path / "ck"
    ids = _save_all(root)
    (root / "manifests" / f"{ids[0]}.json").write_bytes(b"{torn")
    assert main(["diff", str(root), ids[0], ids[1]]) == 1
    assert "unreadable checkpoint manifest" in capsys.readouterr().err
    assert main(["du", str(root), "--json"]) == 1  # which bytes it names is unknown
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["unreadable"]) == 1 and len(doc["checkpoints"]) == 2


@pytest.mark.parametrize("which", ["durable", "fast"])
def test_json_on_ls_show_verify(which, request, capsys) -> None:
    root, ids = request.getfixturevalue(which)
    assert [c["id"] for c in _json(capsys, ["ls", str(root), "--json"])["checkpoints"]] == ids
    shown = _json(capsys, ["show", str(root), "c3", "--json"])
    assert shown["id"] == ids[2] and {t["key"] for t in shown["tensors"]} == {"frozen", "half", "extra"}
    checked = _json(capsys, ["verify", str(root), "--json"])
    assert checked["ok"] is True and checked["checked_checkpoints"] == 3
