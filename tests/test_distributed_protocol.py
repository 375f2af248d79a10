"""A collective Checkpointer on 2 gloo ranks (CPU): commits, disagreements, a rank that does
not save, a SIGKILLed rank, resuming bit-exactly (scenarios in dist_workers.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from dist_support import run_ranks

import gpusnap

pytestmark = pytest.mark.slow


def test_commit_disagreement_restore_and_one_writer(tmp_path: Path) -> None:
    results = run_ranks("protocol", 2, tmp_path)
    assert results[0]["committed"] == results[1]["committed"]
    for r in results:
        assert "another writer holds" in r["second_writer"]
        assert "did not report its part" in r["lonely"]  # rank 1 learns it at its (late) save
    assert "failed on 1 rank(s)" in results[0]["mismatch"] and "rank 1: app_state does not fit" in results[0]["mismatch"]
    assert results[1]["mismatch"].startswith("app_state does not fit")  # its own error
    infos = gpusnap.Checkpointer(tmp_path / "protocol", process_group=False).list()
    assert [i.world_size for i in infos] == [2, 2, 2]


def test_resume_reproduces_the_uninterrupted_run(tmp_path: Path) -> None:
    run_ranks("resume", 2, tmp_path, args={"phase": "first"})
    assert [r["step"] for r in run_ranks("resume", 2, tmp_path, args={"phase": "again"})] == [6, 6]


@pytest.mark.parametrize("victim, moment", [(1, "write"), (0, "durable"), (0, "committed")])
def test_a_rank_killed_during_a_save_commits_nothing(tmp_path: Path, victim: int, moment: str) -> None:
    chunk = random.Random(f"{victim}{moment}").randrange(64)  # a random moment among its 64 chunk writes
    results = run_ranks("kill", 2, tmp_path, args={"victim": victim, "moment": moment, "chunk": chunk},
                        killed=(victim,))
    assert len(results) == 1
    step = 2 if moment == "committed" else 1  # (rank 0 died after it committed the second save)
    state = gpusnap.load(tmp_path / "kill")  # the newest committed save, whole (rank 0's state)
    assert state["step"] == step and torch.equal(state["w"], torch.arange(64 * 1024, dtype=torch.float32) + step - 1)
    assert gpusnap.Checkpointer(tmp_path / "kill", process_group=False).list()[0].world_size == 2
