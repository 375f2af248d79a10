"""keep_last holds within one save of the steady state: a Checkpointer's retention does not
wait for (or skip because of) its own next save's open transaction, also across restarts."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import gpusnap
from gpusnap import Config
from gpusnap.storage import GcReport, Repository


def _config() -> Config:
    return Config(chunk_size=4096, pack_size=64 * 1024, io_threads=2, staging_bytes=4096)


@pytest.fixture()
def next_save_writing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every gc runs while a write transaction of the same Repository is open: what a save
    loop looks like, where the next save's writers hold one whenever the last commit ends."""
    real_gc = Repository.gc
    open_during: list[int] = []

    def gc(self: Repository, *args: Any, **kwargs: Any) -> GcReport:
        with self.begin_write() as txn:
            open_during.append(1)
            report = real_gc(self, *args, **kwargs)
            txn.abort()
        return report

    monkeypatch.setattr(Repository, "gc", gc)
    return open_during


def test_retention_applies_while_the_next_save_writes(
    tmp_path: Path, next_save_writing: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    t = torch.zeros(1 << 14)
    with caplog.at_level(logging.INFO, logger="gpusnap"):
        with gpusnap.Checkpointer(tmp_path / "ck", keep_last=2, config=_config()) as ck:
            for i in range(6):
                t.fill_(i)
                ck.save({"t": t}, tag=f"s{i}").wait()
                assert len(ck.list()) <= 2, f"after save {i}: {[x.tag for x in ck.list()]}"
            assert [x.tag for x in ck.list()] == ["s4", "s5"]
            ck.restore({"t": t}, "s4")
    assert torch.equal(t, torch.full((1 << 14,), 4.0))
    assert next_save_writing and "retention skipped" not in caplog.text
    assert Repository.open(tmp_path / "ck").verify().ok


def test_a_new_checkpointer_trims_a_root_with_too_many_checkpoints_at_its_first_commit(
    tmp_path: Path, next_save_writing: list[int]
) -> None:
    """As after SIGKILLs: more checkpoints than keep_last were left behind."""
    t = torch.zeros(1 << 12)
    with gpusnap.Checkpointer(tmp_path / "ck", config=_config()) as ck:
        for i in range(5):
            t.fill_(i)
            ck.save({"t": t}, blocking=True)
    with gpusnap.Checkpointer(tmp_path / "ck", keep_last=3, config=_config()) as ck:
        assert len(ck.list()) == 5
        t.fill_(5)
        ck.save({"t": t}).wait()
        assert len(ck.list()) == 3
        ck.restore({"t": t})
    assert torch.equal(t, torch.full((1 << 12,), 5.0))
