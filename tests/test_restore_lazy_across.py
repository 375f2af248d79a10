"""A save while a lazy restore of *another* Checkpointer is loading (issue 21, A3).

Restore from a base root, checkpoint to a run root: the save must wait for every lazy
restore in the process (on any thread), commit the restored bytes, and refuse state that a
failed restore left stale, until a successful restore (of any Checkpointer) rewrites it.

Loading is held mid-load (``restore_hold``: the first batch loads, the rest only once
something waits), so a save that does not wait commits the pre-restore bytes.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from restore_hold import hold_loads, snapshot
from restore_support import corrupt_chunk, tiny_config
from torch import nn

import gpusnap
from gpusnap import CheckpointError, IntegrityError


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 8))


def _state(seed: int) -> dict[str, Any]:
    model = _model(seed)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 16)).square().mean().backward()
    optim.step()
    return {"model": model, "optim": optim, "step": seed}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    sa, sb = a["model"].state_dict(), b["model"].state_dict()
    oa, ob = a["optim"].state_dict()["state"], b["optim"].state_dict()["state"]
    return (
        sa.keys() == sb.keys()
        and all(torch.equal(sa[k], sb[k]) for k in sa)
        and all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in ("exp_avg", "exp_avg_sq"))
        and a["step"] == b["step"]
    )


def _on_thread(fn: Any) -> Any:
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(fn()), name="saver")
    worker.start()
    worker.join(120)
    assert out, "the saving thread failed or hung"
    return out[0]


@pytest.mark.parametrize("where", ["same thread", "other thread"])
def test_save_to_another_root_while_a_lazy_restore_loads(tmp_path, monkeypatch, where):
    source = _state(0)
    with (
        gpusnap.Checkpointer(tmp_path / "base", config=tiny_config()) as base,
        gpusnap.Checkpointer(tmp_path / "run", config=tiny_config()) as run,
    ):
        base.save(source, blocking=True)
        target = _state(1)
        hold = hold_loads(monkeypatch, allow=1)  # one batch loads, then the rest is held
        handle = base.restore(target, lazy=True)
        weight = target["model"][2].weight
        assert not torch.equal(snapshot(weight), source["model"][2].weight), "still loading"

        def save() -> Any:
            return run.save(target).wait()

        info = save() if where == "same thread" else _on_thread(save)
        assert hold.waits == ["join"], "the save waited for the other Checkpointer's restore"
        handle.wait()
        check = _state(2)
        run.restore(check, info.id)
    assert _equal(check, source), "the run root's checkpoint holds the restored state"
    assert _equal(target, source)


def test_saves_on_two_threads_both_wait(tmp_path, monkeypatch):
    source = {"a": torch.arange(4096.0), "b": torch.arange(4096.0) * -1}
    with (
        gpusnap.Checkpointer(tmp_path / "base", config=tiny_config()) as base,
        gpusnap.Checkpointer(tmp_path / "run1", config=tiny_config()) as run1,
        gpusnap.Checkpointer(tmp_path / "run2", config=tiny_config()) as run2,
    ):
        base.save(source, blocking=True)
        target = {"a": torch.zeros(4096), "b": torch.zeros(4096)}
        hold_loads(monkeypatch, allow=1)
        handle = base.restore(target, lazy=True)
        results: dict[str, Any] = {}
        threads = [threading.Thread(target=lambda ck=ck, k=k: results.__setitem__(k, ck.save(target).wait()))
                   for k, ck in (("run1", run1), ("run2", run2))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        handle.wait()
        for key, ck in (("run1", run1), ("run2", run2)):
            check = {"a": torch.empty(4096), "b": torch.empty(4096)}
            ck.restore(check, results[key].id)
            assert all(torch.equal(check[k], source[k]) for k in source), key


def test_a_failed_restore_blocks_saves_of_its_stale_tensors_anywhere_until_restored_again(tmp_path):
    base_root = tmp_path / "base"
    source = {"good": torch.arange(256.0), "bad": torch.arange(4096.0) + 0.5, "step": 1}
    with gpusnap.Checkpointer(tmp_path / "run", config=tiny_config()) as run:
        earlier = run.save(source, blocking=True).wait()  # a good copy of the same state
        with gpusnap.Checkpointer(base_root, config=tiny_config()) as base:
            base.save(source, blocking=True)
        corrupt_chunk(base_root, (torch.arange(4096.0) + 0.5)[1024:1152].numpy().tobytes(), 10)
        target = {"good": torch.zeros(256), "bad": torch.zeros(4096), "step": 0}
        with gpusnap.Checkpointer(base_root, config=tiny_config()) as base:
            handle = base.restore(target, lazy=True)
            with pytest.raises(IntegrityError):
                handle.wait()
        # the failed restore's Checkpointer is closed: its stale tensors still may not be saved
        with pytest.raises(CheckpointError, match=r"bad.*restore again before saving"):
            run.save(target)
        refused = _on_thread(lambda: _raised(lambda: run.save({"bad": target["bad"]})))
        assert isinstance(refused, CheckpointError) and "restore again before saving" in str(refused)
        run.save({"other": torch.ones(8)}).wait()  # state it never touched saves as ever
        run.restore(target, earlier.id)  # a successful restore (another Checkpointer) rewrites them
        info = run.save(target).wait()
        check = {"good": torch.empty(256), "bad": torch.empty(4096), "step": 0}
        run.restore(check, info.id)
    assert torch.equal(check["bad"], source["bad"]) and torch.equal(check["good"], source["good"])


def _raised(fn: Any) -> BaseException | None:
    """What ``fn`` raised (run on another thread by ``_on_thread``), or None."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    return None


def test_a_failed_restore_retired_by_its_own_next_restore_stops_blocking(tmp_path):
    root = tmp_path / "base"
    first = {"t": torch.arange(4096.0) + 0.25}
    second = {"t": torch.arange(4096.0) * 3 + 0.75}
    with gpusnap.Checkpointer(root, config=tiny_config()) as base:
        good = base.save(first, blocking=True).wait()
        bad = base.save(second, blocking=True).wait()
    corrupt_chunk(root, second["t"][:128].numpy().tobytes(), 3)  # only in the second checkpoint
    with (
        gpusnap.Checkpointer(root, config=tiny_config()) as base,
        gpusnap.Checkpointer(tmp_path / "run", config=tiny_config()) as run,
    ):
        target = {"t": torch.zeros(4096)}
        handle = base.restore(target, bad.id, lazy=True)
        with pytest.raises(IntegrityError):
            handle.wait()
        with pytest.raises(CheckpointError, match="restore again before saving"):
            run.save(target)
        with pytest.raises(IntegrityError):
            base.restore(target, bad.id)  # retires the failed one, but fails too: still stale
        with pytest.raises(CheckpointError, match="restore again before saving"):
            run.save(target)
        base.restore(target, good.id)  # succeeds: no longer stale
        info = run.save(target).wait()
        check = {"t": torch.empty(4096)}
        run.restore(check, info.id)
    assert torch.equal(check["t"], first["t"])


def test_a_restore_waits_for_another_checkpointers_lazy_restore(tmp_path, monkeypatch):
    """Two loads into the same tensors never interleave: the later restore wins whole."""
    first, second = {"t": torch.arange(4096.0)}, {"t": torch.arange(4096.0) * -2}
    with (
        gpusnap.Checkpointer(tmp_path / "a", config=tiny_config()) as a,
        gpusnap.Checkpointer(tmp_path / "b", config=tiny_config()) as b,
    ):
        a.save(first, blocking=True)
        b.save(second, blocking=True)
        target = {"t": torch.zeros(4096)}
        hold = hold_loads(monkeypatch, allow=1)
        handle = a.restore(target, lazy=True)
        b.restore(target, verify="stream")  # waits for a's load, then writes over it
        assert hold.waits == ["join"]
        handle.wait()
        assert torch.equal(snapshot(target["t"]), second["t"])
