"""The DCP ``async_save`` baseline across saves, and the runner's traceback of a failed row.

On an H200 with torch 2.11 every ``async_save`` row failed with ``KeyError: <class 'type'>``:
torch 2.11's ``DefaultStager._stage`` closes its ``StateDictStager`` after every stage, which
empties the deepcopy dispatch table, so the second save through the same stager fails. torch
2.13 (this CPU venv) does not close there; ``_closing_stage`` puts 2.11's line back so the CPU
tests run the path that failed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from gpusnap.bench.baselines.dcp import DcpAsyncSave, dcp_unavailable
from gpusnap.bench.measure import measure_save, plain_steps
from gpusnap.bench.runner import BenchOptions, _Budget, _run_system
from gpusnap.bench.system import System
from gpusnap.bench.verify import clone_state, compare
from gpusnap.bench.workloads import Workload, build_workload

pytestmark = pytest.mark.skipif(dcp_unavailable() is not None, reason=str(dcp_unavailable()))


def _closing_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DefaultStager._stage`` as torch 2.11 has it: ``self._state_dict_stager.close()`` after
    every stage ("release reference cycle to prevent memory leaks in async_save")."""
    from torch.distributed.checkpoint.staging import DefaultStager

    original = DefaultStager._stage

    def stage_then_close(self: Any, state_dict: Any, **kwargs: Any) -> Any:
        staged = original(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged

    # private (torch's): DCP's stager has no public hook between staging and its next use
    monkeypatch.setattr(DefaultStager, "_stage", stage_then_close)


def _load(system: DcpAsyncSave, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    assert system._latest is not None
    got = {name: torch.full_like(t, 7) for name, t in like.items()}
    dcp.load(got, checkpoint_id=system._latest, no_dist=True)
    return got


def _three_saves(wl: Workload, tmp_path: Path) -> tuple[DcpAsyncSave, list[str]]:
    """Three saves as the runner makes them (steps between, the step waiting for staging);
    each checkpoint loaded back and compared bit for bit with the state at its save."""
    plain = plain_steps(wl, 2, warmup=1)
    system = DcpAsyncSave(str(tmp_path))
    system.setup(wl)
    try:
        for i in range(3):
            for _ in range(system.gap_steps):
                wl.step()
            system.prepare_save(wl, i)
            expected = clone_state(wl)
            sample = measure_save(wl, system, i, plain, max_window_steps=1000, max_window_s=60.0)
            assert sample.captured_s is not None and sample.durable_s is not None
            ok, detail = compare(expected, _load(system, expected))
            assert ok, (i, detail)
        return system, system.notes()
    finally:
        system.teardown()


def test_a_stager_that_closes_after_each_stage_fails_the_second_save(monkeypatch, tmp_path):
    """The root cause, without the bench: torch 2.11's stager cannot stage twice."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    _closing_stage(monkeypatch)
    stager = DefaultStager(StagingOptions(False, False, False, False))
    state = {"w": torch.arange(4.0)}
    try:
        dcp.async_save(state, checkpoint_id=str(tmp_path / "0"), async_stager=stager, no_dist=True).result()
        with pytest.raises(KeyError, match="<class 'type'>"):
            dcp.async_save(state, checkpoint_id=str(tmp_path / "1"), async_stager=stager, no_dist=True)
    finally:
        stager.close()


@pytest.mark.parametrize("workload", ["gpt2", "decode"])
def test_async_save_survives_torch_211_stager(monkeypatch, tmp_path, workload):
    """Failed before the fix with KeyError: <class 'type'> at the second save."""
    _closing_stage(monkeypatch)
    wl = build_workload(workload, torch.device("cpu"), size="tiny")
    system, notes = _three_saves(wl, tmp_path)
    assert system._deferred is not None and system._deferred.calls == 3
    assert any("deferred that close" in n for n in notes), notes
    assert system._stager is None  # teardown closed it for real ...
    assert not system._deferred.inner._cached_storage_mapping  # ... pinned cache dropped
    assert not system._deferred.inner._deepcopy_dispatch


def test_async_save_warm_saves_reuse_the_staged_copy(monkeypatch, tmp_path):
    """This torch's stager as it is: the staged copy of the first save is refreshed in place by
    the next ones (the warm saves the row reports), and no note when torch closes nothing."""
    from torch.distributed.checkpoint.staging import DefaultStager

    wl = build_workload("gpt2", torch.device("cpu"), size="tiny")
    storages: list[set[int]] = []
    original = DefaultStager._stage

    def recording(self: Any, state_dict: Any, **kwargs: Any) -> Any:
        staged = original(self, state_dict, **kwargs)
        storages.append({t.untyped_storage().data_ptr() for t in staged.values()})
        return staged

    # private (torch's): what DCP's stager staged into is visible nowhere else
    monkeypatch.setattr(DefaultStager, "_stage", recording)
    system, notes = _three_saves(wl, tmp_path)
    assert len(storages) == 3 and storages[0] == storages[1] == storages[2]
    deferred = getattr(system, "_deferred", None)
    calls = deferred.calls if deferred is not None else 0
    assert any("deferred that close" in n for n in notes) == (calls > 0)


@pytest.mark.cuda
@pytest.mark.parametrize("workload", ["gpt2", "decode"])
def test_async_save_on_cuda_pinned_async_staging(tmp_path, workload):
    """The path that failed on the H200: pinned memory, async staging on a side stream,
    non-blocking copies, one DefaultStager for every save."""
    wl = build_workload(workload, torch.device("cuda"), size="tiny")
    system, notes = _three_saves(wl, tmp_path)
    assert any("use_pinned_memory=True" in n and "use_async_staging=True" in n for n in notes), notes
    assert system.pinned_bytes() == wl.state_bytes()


# -- the runner keeps where a failure was raised -------------------------------------------------


def _deep_raise(depth: int) -> None:
    if depth == 0:
        raise KeyError(type)
    _deep_raise(depth - 1)


class _Failing(System):
    key = "failing"
    label = "failing"

    def save(self, wl: Workload, index: int) -> Any:
        _deep_raise(30)  # a raise site far below the bench's own frames, as in DCP's stager


def test_failed_row_keeps_the_raise_site_in_its_traceback(tmp_path):
    state: dict[str, Any] = {"model": torch.nn.Linear(2, 2)}
    wl = Workload("fake", "training", torch.device("cpu"), state, lambda hook=None: time.sleep(0.001), "fake")
    opts = BenchOptions(workloads=["fake"], device=torch.device("cpu"), quick=True, out=str(tmp_path),
                        root=str(tmp_path), disk_root=str(tmp_path)).resolved()
    plain = plain_steps(wl, 2, warmup=0)
    row = _run_system(wl, wl, _Failing(), plain, opts, _Budget(None), [])
    assert row["status"] == "failed: KeyError: <class 'type'>"
    tb = row["traceback"]
    assert "_run_system" in tb  # the outer end: which call of the bench
    assert "raise KeyError(type)" in tb and tb.rstrip().endswith("KeyError: <class 'type'>")  # the raise site
    assert "frames left out" in tb and len(tb.splitlines()) < 60
