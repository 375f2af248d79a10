"""The default path: ``Checkpointer(root)`` captures into a memory tier of its own and makes
each save durable in ``root`` in the background (docs/tiers.md, "The default is a memory
tier"); where that memory is refused it writes to ``root`` directly and says so once."""

from __future__ import annotations

import json
import logging
import stat
import textwrap
from pathlib import Path

import pytest
import torch
from fast_support import blank_state, make_state, memory_tier_of, run_killed, run_on_small_tmpfs, same, snapshot, train

import gpusnap
from gpusnap.storage.chunk_names import is_device_name
from gpusnap.storage.manifest import DEVICE_NAMED_VERSION
from gpusnap.storage.repository import Repository

pytestmark = pytest.mark.memory_tier

CFG = gpusnap.Config(chunk_size=64 * 1024, copy_piece_bytes=256 * 1024, fast_slab_bytes=2 << 20)


def _versions(root: Path) -> list[int]:
    return sorted(json.loads(p.read_text())["version"] for p in (root / "manifests").glob("*.json"))


def test_a_default_checkpointer_saves_into_memory_and_makes_every_save_durable(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    state = make_state(1)
    saved = []
    with gpusnap.Checkpointer(root, keep_last=2, config=CFG) as ck:
        for step in range(2, 5):
            train(state, step)
            info = ck.save(state, tag=f"s{step}").wait()
            assert info.tier == "fast" and info.stats["memory_tier"].startswith("on: ")
            assert info.stats["host_memory_bytes"] > 0
            saved.append((info.id, snapshot(state)))
        ck.wait()  # the promotions too
        durable = [i for i in ck.list() if i.tier == "durable"]
        assert [i.tag for i in durable] == ["s3", "s4"]  # keep_last=2; tagged saves are never skipped
        tier = memory_tier_of(root)
        assert tier.is_dir() and stat.S_IMODE(tier.parent.stat().st_mode) == 0o700
    assert not tier.exists(), "a clean close() removes the memory tier"
    assert _versions(root) == [DEVICE_NAMED_VERSION] * 2
    repo = Repository.open(root)
    names = [c for m in repo.list() for e in m.storages for c in e.chunks]
    assert names and all(is_device_name(c) for c in names)
    assert repo.verify().ok
    for ckpt_id, expected in saved[1:]:
        target = blank_state(state)
        with gpusnap.Checkpointer(root, config=CFG) as ck:
            ck.restore(target, ckpt_id)
        assert same(snapshot(target), expected) == []


def test_a_save_between_backward_and_step_is_bit_exact_once_durable(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    state = make_state(3)
    model, optim = state["model"], state["optim"]
    model(torch.randn(8, model[0].in_features)).square().mean().backward()
    expected = snapshot(state)
    with gpusnap.Checkpointer(root, config=CFG) as ck:
        pending = ck.save(state)
        optim.step()  # rewrites every parameter and moment while they are captured
        pending.wait()
    restored = blank_state(state)
    with gpusnap.Checkpointer(root, config=gpusnap.Config(memory_tier="off")) as ck:
        assert [i.tier for i in ck.list()] == ["durable"]
        ck.restore(restored)
    assert same(snapshot(restored), expected) == []


KILLED = textwrap.dedent(
    """
    import json, os, signal, sys
    sys.path.insert(0, sys.argv[2])
    import gpusnap
    from fast_support import make_state, snapshot
    cfg = gpusnap.Config(chunk_size=64 * 1024, copy_piece_bytes=256 * 1024, fast_slab_bytes=2 << 20)
    ck = gpusnap.Checkpointer(sys.argv[1], config=cfg, promote_every=100)  # (nothing promoted before the kill)
    info = ck.save(make_state(2)).wait()
    print(info.id, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_memory_tier_left_by_a_killed_process_is_read_and_made_durable(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    left = run_killed(tmp_path, KILLED, root)
    assert memory_tier_of(root).is_dir() and not list(root.glob("manifests/*.json"))  # (never promoted)
    expected = snapshot(make_state(2))
    with gpusnap.Checkpointer(root, config=CFG) as again:
        assert [(i.id, i.tier) for i in again.list()] == [(left, "fast")]  # read from the memory tier
        target = blank_state(make_state(2))
        again.restore(target, left)
        assert same(snapshot(target), expected) == []
        again.save(target).wait()  # its first save opens the tier: the checkpoint left there is promoted
        again.wait()
        assert left in [i.id for i in again.list() if i.tier == "durable"]
    assert not memory_tier_of(root).exists()


def test_close_makes_the_newest_checkpoint_durable_even_between_promotions(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    state = make_state(4)
    with gpusnap.Checkpointer(root, config=CFG, promote_every=3) as ck:  # (no save is due)
        ids = []
        for step in range(5, 7):
            train(state, step)
            ids.append(ck.save(state).wait().id)
    durable = [i.id for i in Repository.open(root).list()]
    assert ids[-1] in durable and not memory_tier_of(root).exists()


def test_a_missing_memory_directory_falls_back_to_the_root_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = gpusnap.Config(chunk_size=64 * 1024, memory_tier_dir=str(tmp_path / "no-such-dir"))
    state = make_state(5)
    with caplog.at_level(logging.WARNING, logger="gpusnap"):
        with gpusnap.Checkpointer(tmp_path / "ck", config=cfg) as ck:
            infos = [ck.save(state).wait() for _ in range(2)]
    warned = [r for r in caplog.records if "no host memory tier" in r.getMessage()]
    assert len(warned) == 1
    assert all(i.tier == "durable" and i.stats["memory_tier"].startswith("off: no host memory tier") for i in infos)


def test_memory_tier_off_writes_the_root_directly_without_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSNAP_MEMORY_TIER", "off")
    with caplog.at_level(logging.WARNING, logger="gpusnap"):
        with gpusnap.Checkpointer(tmp_path / "ck", config=CFG) as ck:
            info = ck.save(make_state(6)).wait()
    assert info.tier == "durable" and info.stats["memory_tier"] == "off: Config.memory_tier='off'"
    assert not caplog.records
    assert _versions(tmp_path / "ck") == [1]  # (BLAKE2b names: readable by every gpusnap)
    with pytest.raises(ValueError, match="promote_every"):
        gpusnap.Checkpointer(tmp_path / "ck2", config=CFG, promote_every=2)


SMALL_SHM = textwrap.dedent(
    """
    import json, logging, os, subprocess, sys, torch, gpusnap
    logging.basicConfig(level=logging.WARNING)
    mount, durable = sys.argv[1], sys.argv[2]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", mount], check=True)
    os.environ.pop("GPUSNAP_MEMORY_TIER", None)
    cfg = gpusnap.Config(chunk_size=64 * 1024, copy_piece_bytes=256 * 1024, fast_slab_bytes=2 << 20,
                         memory_tier_dir=mount)
    state = {"w": torch.arange(1_000_000, dtype=torch.float32), "step": 1}  # 4 MB: 3 of them need 12 MB
    with gpusnap.Checkpointer(durable, config=cfg) as ck:
        infos = [ck.save(state).wait() for _ in range(2)]
        listed = [i.tier for i in ck.list()]
    target = {"w": torch.zeros(1_000_000), "step": 0}
    gpusnap.Checkpointer(durable, config=cfg).restore(target).wait()
    print(json.dumps({"notes": [i.stats["memory_tier"] for i in infos], "tiers": [i.tier for i in infos],
                      "listed": listed, "equal": bool(torch.equal(target["w"], state["w"]))}))
    """
)


def test_a_small_dev_shm_falls_back_to_the_root_with_one_warning(tmp_path: Path) -> None:
    run = run_on_small_tmpfs(tmp_path, SMALL_SHM, str(tmp_path / "durable"))
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["tiers"] == ["durable", "durable"] and out["equal"], out
    assert all(n.startswith("off: the memory tier") and "no room" in n for n in out["notes"]), out
    assert run.stderr.count("has no room for this state") == 1, run.stderr


def test_gpusnap_du_reports_the_memory_tier_of_a_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gpusnap.cli.main import main

    root = tmp_path / "ck"
    ck = gpusnap.Checkpointer(root, config=CFG)
    try:
        ck.save(make_state(7)).wait()
        ck.wait()
        assert main(["du", str(root), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["memory_tier"]["path"] == str(memory_tier_of(root)) and doc["memory_tier"]["host_bytes"] > 0
    finally:
        ck.close()
    assert main(["du", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_tier"] is None
