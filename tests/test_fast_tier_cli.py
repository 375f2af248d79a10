"""``gpusnap ls/show/verify/gc`` on a fast tier's root (and the tier of a durable root's rows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fast_support import CFG, blank_state, make_state, same, snapshot, train

import gpusnap
from gpusnap.cli.main import main


@pytest.fixture
def tiers(tmp_path: Path) -> tuple[Path, Path, list[str], dict]:
    """A durable root with one promoted checkpoint, and a fast root with three (the promoted
    one among them); returns both, the fast ids and the newest's values."""
    durable, fast = tmp_path / "durable", tmp_path / "fast"
    state = make_state(1)
    ids = []
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, fast_keep_last=3) as ck:
        ids.append(ck.save(state, tag="first", promote=True).wait().id)
        for step in (2, 3):
            train(state, step)
            ids.append(ck.save(state).wait().id)
    return durable, fast, ids, snapshot(state)


def _rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines()]


def test_ls_shows_the_tier_of_each_root(tiers, capsys) -> None:
    durable, fast, ids, _ = tiers
    assert main(["ls", str(fast)]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows[0][-2:] == ["COMMITTED", "TIER"]  # a fast tier commits in host memory: not durable
    assert [(r[0], r[-1]) for r in rows[1:]] == [(i, "fast") for i in ids]
    assert main(["ls", str(durable)]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows[0][-2:] == ["DURABLE", "TIER"]
    assert [(r[0], r[-1]) for r in rows[1:]] == [(ids[0], "durable")]


def test_ls_json_has_the_tier_of_each_checkpoint(tiers, capsys) -> None:
    durable, fast, ids, _ = tiers
    assert main(["ls", str(fast), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(c["id"], c["tier"]) for c in doc["checkpoints"]] == [(i, "fast") for i in ids]
    assert main(["ls", str(durable), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(c["id"], c["tier"]) for c in doc["checkpoints"]] == [(ids[0], "durable")]


def test_show_names_the_tier(tiers, capsys) -> None:
    _durable, fast, ids, _ = tiers
    assert main(["show", str(fast), "first"]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {ids[0]}" in out and ["tier", "fast"] in _rows(out)
    assert main(["show", str(fast), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["id"] == ids[-1] and doc["tier"] == "fast"
    assert {t["key"] for t in doc["tensors"]} >= {"x", "model/0.weight"}


def test_verify_of_a_clean_fast_root_checks_every_chunk(tiers, capsys) -> None:
    durable, fast, ids, _ = tiers
    assert main(["verify", str(fast)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok: 3 checkpoint(s)"), out
    assert main(["verify", str(fast), ids[1], "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["checked_checkpoints"] == 1 and doc["checked_chunks"] > 0
    assert main(["verify", str(durable)]) == 0


def test_gc_keep_last_on_a_fast_root_deletes_manifests_and_keeps_the_slabs(tiers, capsys) -> None:
    durable, fast, ids, newest = tiers
    slabs = sorted(p.name for p in (fast / "slabs").iterdir())
    assert main(["gc", str(fast), "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert "deleted 2 checkpoint(s) from the fast tier" in out and "slab files are kept" in out, out
    assert sorted(p.name for p in (fast / "slabs").iterdir()) == slabs
    assert main(["ls", str(fast), "--json"]) == 0
    assert [c["id"] for c in json.loads(capsys.readouterr().out)["checkpoints"]] == [ids[-1]]
    assert main(["verify", str(fast)]) == 0
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        assert [(i.id, i.tier) for i in ck.list()] == [(ids[0], "durable"), (ids[-1], "fast")]
        target = blank_state(make_state(0))
        ck.restore(target)
        assert same(snapshot(target), newest) == []
        ck.save(target).wait()  # and the tier takes saves again, in the slabs it kept
    assert sorted(p.name for p in (fast / "slabs").iterdir()) == slabs
