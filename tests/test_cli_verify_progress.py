"""``gpusnap verify``'s bar ends full, in the unit of the summary under it: verify checks a
chunk that checkpoints share once, so it tells the bar what it will check (``on_total``),
not the checkpoints' sizes added up."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from restore_support import tiny_config

import gpusnap
from gpusnap.cli.main import main
from gpusnap.storage import Repository


def _incremental(root: Path, **kwargs: object) -> None:
    """Four checkpoints of which each changes one element: they share most chunks."""
    w = torch.randn(16 * 1024, generator=torch.Generator().manual_seed(0))
    with gpusnap.Checkpointer(root, config=tiny_config(), **kwargs) as ckpt:  # type: ignore[arg-type]
        for step in range(4):
            w[step] += 1
            ckpt.save({"w": w, "step": step}, blocking=True)


@pytest.mark.parametrize("tier", ["durable", "fast"])
def test_the_total_is_what_verify_then_checks(tmp_path: Path, tier: str) -> None:
    root = tmp_path / "ck"
    if tier == "fast":
        _incremental(root, fast_root=tmp_path / "fast", fast_keep_last=4)
        root = tmp_path / "fast"
    else:
        _incremental(root)
    repo = Repository.open(root)
    totals: list[int] = []
    advances: list[int] = []
    report = repo.verify(on_total=totals.append, progress=advances.append)
    assert report.ok and len(totals) == 1
    assert totals[0] == sum(advances) == report.checked_bytes
    assert totals[0] < sum(m.nbytes for m in repo.list())  # (shared chunks: what the bar used to take)


def test_the_bar_ends_full_in_the_units_of_the_summary(tmp_path: Path, monkeypatch, capsys) -> None:
    _incremental(tmp_path / "ck")
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    assert main(["verify", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    frames = re.findall(r"verifying\b.*?([\d.]+)/([\d.]+) (\w+)", out)
    assert frames, out
    done, total, unit = frames[-1]  # the last frame drawn, before the bar is erased
    summary = re.search(r"ok: .*, ([\d.]+) (\w+) checked$", out, re.M)
    assert summary, out
    assert (done, unit) == (total, summary.group(2)) and total == summary.group(1)
