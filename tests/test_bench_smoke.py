"""``gpusnap bench`` end to end on CPU (tiny sizes), and its measurements on fakes.

The CPU run proves the bench runs and checks itself; its figures are not performance
claims, and every output must say so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gpusnap.bench import gpusnap_variants
from gpusnap.bench.env import CPU_DISCLAIMER
from gpusnap.bench.measure import PlainSteps, measure_save
from gpusnap.bench.report import markdown
from gpusnap.bench.runner import _every_steps
from gpusnap.bench.summary import derived_throughput
from gpusnap.bench.system import SaveHandle, System, blocking_handle
from gpusnap.bench.workloads import Workload, build_workload
from gpusnap.cli.main import main


def _bench(tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    out = tmp_path / "out"
    code = main(["bench", "--quick", "--device", "cpu", "--out", str(out), "--root", str(tmp_path / "root"),
                 "--disk-root", str(tmp_path / "disk"), "--no-plots", *extra])
    results = json.loads((out / "results.json").read_text())
    return code, results, (out / "results.md").read_text()


def _row(results: dict[str, Any], workload: str, key: str) -> dict[str, Any]:
    wl = next(w for w in results["workloads"] if w["name"] == workload)
    return next(r for r in wl["systems"] if r["key"] == key)


def test_quick_cpu_run_end_to_end(tmp_path):
    # (how long it takes is a benchmark's business, not a unit test's: ~10 s on 2 cores)
    code, results, md = _bench(tmp_path)
    assert code == 0

    env = results["environment"]
    for key in ("date", "torch", "python", "device", "gpu", "cuda_runtime", "gpusnap", "filesystems"):
        assert key in env, key
    assert results["disclaimer"] == CPU_DISCLAIMER
    assert {w["name"] for w in results["workloads"]} == {"gpt2", "decode"}

    for workload in ("gpt2", "decode"):
        wl = next(w for w in results["workloads"] if w["name"] == workload)
        assert wl["status"] == "ok" and wl["state_bytes"] > 0 and wl["median_step_s"] > 0
        for key in ("gpusnap_concurrent", "gpusnap_blocking", "gpusnap_incremental", "torch_save_tmpfs",
                    "torch_save_disk", "dcp_save", "dcp_async"):
            row = _row(results, workload, key)
            assert row["status"] == "ok", (key, row["status"], row.get("traceback"))
            assert len(row["saves"]) >= 1
            for sample in row["saves"]:
                assert isinstance(sample["stall_s"], float) and isinstance(sample["call_s"], float)
                assert sample["captured_s"] is not None and sample["durable_s"] is not None
                assert sample["durable_s"] >= sample["captured_s"] - 0.005  # watcher's poll period
        # Baselines that need CUDA say so instead of pretending.
        assert _row(results, workload, "pinned_copy")["status"] == "skipped: no CUDA"
        assert _row(results, workload, "cuda_checkpoint")["status"] == "skipped: no CUDA"
        # gpusnap's rows were restored into a fresh instance and compared bit for bit.
        checks = wl["correctness"]
        assert {c["system"] for c in checks} >= {"gpusnap_concurrent", "gpusnap_blocking", "gpusnap_incremental"}
        assert all(c["ok"] for c in checks), checks
        concurrent = _row(results, workload, "gpusnap_concurrent")
        assert concurrent["restore"]["eager_s"] > 0
        assert [t["every"] for t in concurrent["throughput"]] == [10]
        assert concurrent["throughput"][0]["how"] == "measured"
        assert isinstance(_row(results, workload, "torch_save_tmpfs")["stall_vs_gpusnap"], float)

    assert CPU_DISCLAIMER in md
    assert "| gpusnap concurrent |" in md and "| torch.save (" in md
    assert "## Where gpusnap concurrent is not ahead" in md
    assert not list((tmp_path / "root").glob("run-*")), "checkpoint roots must be cleaned up"


def test_failed_correctness_check_fails_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(gpusnap_variants, "compare", lambda expected, got: (False, "forced mismatch"))
    code, results, md = _bench(tmp_path, "--workload", "decode", "--systems", "gpusnap_concurrent,torch_save_tmpfs")
    assert code == 1
    checks = results["workloads"][0]["correctness"]
    assert checks and not any(c["ok"] for c in checks)
    assert "FAILED" in md and "forced mismatch" in md


def test_unknown_workload_is_a_usage_error(tmp_path, capsys):
    assert main(["bench", "--device", "cpu", "--workload", "bert", "--out", str(tmp_path)]) == 2
    assert "unknown workload 'bert'" in capsys.readouterr().err


# -- the measurements themselves, on fakes with known costs -------------------------------------

STEP_S = 0.02


class _Clock:
    """Virtual time for the measurement tests: ``sleep`` advances it, nothing else does, so
    the figures are exact on any machine (real sleeps overshoot on a loaded CI host)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    from gpusnap.bench import measure, system

    virtual = _Clock()
    monkeypatch.setattr(measure, "time", virtual)
    monkeypatch.setattr(system, "time", virtual)
    return virtual


def _sleepy_workload(clock: _Clock, slow_steps: list[float]) -> Workload:
    """Each step takes STEP_S, plus whatever ``slow_steps`` holds for the next steps."""
    state: dict[str, Any] = {"model": torch.nn.Linear(2, 2)}

    def step(hook: Any = None) -> None:
        if hook is not None:
            hook()
        clock.sleep(STEP_S + (slow_steps.pop(0) if slow_steps else 0.0))

    return Workload("fake", "training", torch.device("cpu"), state, step, "fake")


class _Blocking(System):
    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    def save(self, wl: Workload, index: int) -> SaveHandle:
        started = self.clock.perf_counter()
        self.clock.sleep(0.1)
        return blocking_handle(started)


class _Background(System):
    """Returns at once; durable 0.15 s later; makes the next three steps 0.03 s slower."""

    def __init__(self, clock: _Clock, slow_steps: list[float]) -> None:
        self.clock, self.slow_steps = clock, slow_steps

    def save(self, wl: Workload, index: int) -> SaveHandle:
        started = self.clock.perf_counter()
        self.slow_steps += [0.03, 0.03, 0.03]
        done_at = started + 0.15
        return SaveHandle(started=started, returned=self.clock.perf_counter(), is_captured=lambda: True,
                          is_durable=lambda: self.clock.perf_counter() >= done_at - 1e-9, wait=dict)


def test_stall_of_a_blocking_save_is_its_duration(clock: _Clock) -> None:
    plain = PlainSteps(median_s=STEP_S, samples=[STEP_S], peak_extra_bytes=0)
    sample = measure_save(_sleepy_workload(clock, []), _Blocking(clock), 0, plain, max_window_steps=100, max_window_s=5)
    assert sample.steps_in_window == 0
    assert sample.stall_s == pytest.approx(0.1)
    assert sample.durable_s == pytest.approx(sample.captured_s, abs=1e-9)


def test_stall_of_a_background_save_sums_every_slowed_step_until_durable(clock: _Clock) -> None:
    slow: list[float] = []
    plain = PlainSteps(median_s=STEP_S, samples=[STEP_S], peak_extra_bytes=0)
    sample = measure_save(_sleepy_workload(clock, slow), _Background(clock, slow), 0, plain,
                          max_window_steps=100, max_window_s=5)
    assert sample.call_s == 0.0
    assert sample.steps_in_window >= 2  # it kept stepping until durable
    assert sample.stall_s == pytest.approx(0.09)  # 3 x 0.03 s, not just the first step's 0.03 s
    assert sample.stall_first_step_s == pytest.approx(0.03)
    assert sample.durable_s >= 0.15 - 1e-9


def test_report_names_every_baseline_that_beats_gpusnap():
    def row(key: str, family: str, stall: float) -> dict[str, Any]:
        return {"key": key, "system": key, "family": family, "status": "ok", "stall_first_s": stall,
                "stall_warm_s": stall, "durable_warm_s": 1.0, "durable_first_s": 1.0, "throughput": [],
                "saves": [{"durable_note": None}], "restore": None}

    results = {
        "disclaimer": None,
        "environment": {"date": "d", "torch": "t", "python": "p", "gpusnap": "g", "gpu": "H200", "driver": "1"},
        "workloads": [{"name": "w", "status": "ok", "impl": "i", "config": {}, "state_bytes": 10**9,
                       "median_step_s": 0.1, "d2h": {"GBps": 50.0, "bytes": 1 << 30}, "correctness": [],
                       "systems": [row("gpusnap_concurrent", "gpusnap", 0.2), row("pinned_copy", "baseline", 0.05),
                                   row("torch_save_tmpfs", "baseline", 2.0)]}],
    }
    text = markdown(results)
    assert "pinned_copy stalls less (50.0 ms vs 200.0 ms per save)" in text
    assert "torch_save_tmpfs stalls less" not in text
    assert CPU_DISCLAIMER not in text


def test_report_flags_negative_stalls_as_a_drifted_baseline():
    row = {"key": "gpusnap_concurrent", "system": "gpusnap concurrent", "family": "gpusnap", "status": "ok",
           "throughput": [], "restore": None,
           "saves": [{"stall_s": 0.3, "durable_note": None}, {"stall_s": -1.5, "durable_note": None}]}
    results = {
        "disclaimer": None,
        "environment": {"date": "d", "torch": "t", "python": "p", "gpusnap": "g", "gpu": "H200", "driver": "1"},
        "workloads": [{"name": "w", "status": "ok", "impl": "i", "config": {}, "state_bytes": 10**9,
                       "median_step_s": 0.1, "d2h": {"GBps": 50.0, "bytes": 1 << 30}, "correctness": [],
                       "systems": [row]}],
    }
    text = markdown(results)
    assert "## Caveats" in text and "negative stall at save 1" in text
    assert "save 0" not in text


def test_derived_loss_counts_the_wait_for_a_save_slower_than_the_interval():
    # a 10 ms stall but 3 s to durable, steps of 100 ms: saving every step cannot cost only 10%
    row = {"stall_warm_s": 0.01, "stall_first_s": 0.5, "durable_warm_s": 3.0, "durable_first_s": 4.0}
    loss = {t["every"]: t["loss"] for t in derived_throughput(row, 0.1)}
    assert loss[1] == pytest.approx(29.0) and loss[10] == pytest.approx(2.0)
    assert loss[100] == pytest.approx(0.001), "durable within the interval: the stall alone"


def test_derived_loss_waits_for_the_write_not_for_the_capture():
    # captured after 1 s, durable after 3 s: the write (2 s) is what a save every step waits for
    row = {"stall_warm_s": 0.01, "stall_first_s": 0.5, "durable_warm_s": 3.0, "durable_first_s": 4.0,
           "captured_warm_s": 1.0, "captured_first_s": 1.0}
    loss = {t["every"]: t["loss"] for t in derived_throughput(row, 0.1)}
    assert loss[1] == pytest.approx(19.0) and loss[10] == pytest.approx(1.0)


@pytest.mark.parametrize("n", [1, 2, 5, 10, 11, 15, 19, 20, 33, 100])
def test_every_n_run_lets_its_last_save_drain_behind_n_minus_1_steps(n):
    steps = _every_steps(n)
    last_save = max(i for i in range(steps) if i % n == 0)  # measure.every_n saves at i % n == 0
    assert steps - 1 - last_save >= n - 1 and steps >= 3


def test_workload_state_counts_tied_weights_once():
    wl = build_workload("gpt2", torch.device("cpu"), size="tiny")
    names = wl.tensors()
    assert not any(n.endswith(("lm_head.weight", "head.weight")) for n in names)
    assert wl.state_bytes() == sum(t.untyped_storage().nbytes() for t in names.values())
    assert any(n.startswith("optim.") for n in names)  # primed: optimizer state exists


# -- the CUDA driver's checkpoint API, against a fake cuda.bindings.driver ----------------------


class _FakeDriver:
    """Mimics cuda-python's binding: every call returns a tuple led by a CUresult."""

    class CUresult:
        CUDA_SUCCESS = 0
        CUDA_ERROR_NOT_SUPPORTED = 801

    class CUcheckpointLockArgs:
        timeoutMs = 0

    def __init__(self, fail: str | None = None) -> None:
        self.fail = fail
        self.calls: list[tuple[str, int]] = []
        self.state = "CU_PROCESS_STATE_RUNNING"

    def _op(self, name: str, pid: int, new_state: str) -> tuple[int]:
        self.calls.append((name, pid))
        if name == self.fail:
            return (self.CUresult.CUDA_ERROR_NOT_SUPPORTED,)
        self.state = new_state
        return (self.CUresult.CUDA_SUCCESS,)

    def cuInit(self, flags: int) -> tuple[int]:
        return (0,)

    def cuGetErrorName(self, err: int) -> tuple[int, bytes]:
        return (0, b"CUDA_ERROR_NOT_SUPPORTED")

    def cuCheckpointProcessLock(self, pid: int, args: Any) -> tuple[int]:
        assert args.timeoutMs > 0
        return self._op("lock", pid, "CU_PROCESS_STATE_LOCKED")

    def cuCheckpointProcessCheckpoint(self, pid: int, args: Any) -> tuple[int]:
        return self._op("checkpoint", pid, "CU_PROCESS_STATE_CHECKPOINTED")

    def cuCheckpointProcessRestore(self, pid: int, args: Any) -> tuple[int]:
        return self._op("restore", pid, "CU_PROCESS_STATE_LOCKED")

    def cuCheckpointProcessUnlock(self, pid: int, args: Any) -> tuple[int]:
        return self._op("unlock", pid, "CU_PROCESS_STATE_RUNNING")

    def cuCheckpointProcessGetState(self, pid: int) -> tuple[int, str]:
        return (0, self.state)


def test_driver_cycle_calls_lock_checkpoint_restore_unlock_in_order():
    from gpusnap.bench.driver_ckpt import DriverApi, cycle

    fake = _FakeDriver()
    times = cycle(DriverApi(fake), 4242)
    assert [c for c, _ in fake.calls] == ["lock", "checkpoint", "restore", "unlock"]
    assert {pid for _, pid in fake.calls} == {4242}
    assert set(times) == {"lock_s", "checkpoint_s", "restore_s", "unlock_s"}


def test_driver_failure_names_the_call_and_leaves_the_child_running():
    from gpusnap.bench.driver_ckpt import DriverApi, DriverError, cycle

    fake = _FakeDriver(fail="checkpoint")
    with pytest.raises(DriverError, match="cuCheckpointProcessCheckpoint: CUDA_ERROR_NOT_SUPPORTED"):
        cycle(DriverApi(fake), 7)
    assert fake.calls[-1][0] == "unlock" and fake.state == "CU_PROCESS_STATE_RUNNING"
