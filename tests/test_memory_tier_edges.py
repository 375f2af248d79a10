"""The memory tier's edges: imports keep BLAKE2b names, tagged saves off the cadence, a tier
refused mid-run, a tier left by a killed process read by a restart without it, SIGTERM."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from fast_support import make_state, memory_tier_of, run_killed, train

import gpusnap
from gpusnap.storage.chunk_names import is_device_name
from gpusnap.storage.repository import Repository

pytestmark = pytest.mark.memory_tier

CFG = gpusnap.Config(chunk_size=64 * 1024, copy_piece_bytes=256 * 1024, fast_slab_bytes=2 << 20)


def test_import_keeps_blake2b_names(tmp_path: Path) -> None:
    """docs/tiers.md: 'Bytes from outside the program (gpusnap import of someone's file ...)
    keep BLAKE2b names ... a crafted file cannot stand in for a chunk of the program's'."""
    src = tmp_path / "model.pt"
    torch.save({"w": torch.arange(300_000, dtype=torch.float32)}, src)
    root = tmp_path / "ck"
    gpusnap.import_(str(src), str(root), config=CFG)
    names = [c for m in Repository.open(str(root)).list() for e in m.storages for c in e.chunks]
    print(names[:3])
    assert names and not any(is_device_name(c) for c in names), "imported bytes were stored under nh: names"


def test_tagged_save_off_cadence_survives(tmp_path: Path) -> None:
    """docs/tiers.md: 'a tagged save is never skipped'; promote_every=N applies to the memory tier."""
    root = tmp_path / "ck"
    state = make_state(1)
    with gpusnap.Checkpointer(root, config=CFG, promote_every=2) as ck:
        best = ck.save(state, tag="best").wait()  # save 1: not on the cadence
        train(state, 2)
        ck.save(state).wait()  # save 2: promoted; fast_keep_last=1 drops 'best' from memory
        ck.wait()
        tags = [i.tag for i in ck.list()]
    print("tags after close:", tags, [i.id for i in Repository.open(str(root)).list()], best.id)
    assert "best" in tags, "the tagged checkpoint is gone from both tiers, with no error"


SMALL = textwrap.dedent(
    """
    import json, logging, os, sys, torch, gpusnap
    logging.basicConfig(level=logging.WARNING)
    mount, durable = sys.argv[1], sys.argv[2]
    os.environ.pop("GPUSNAP_MEMORY_TIER", None)
    cfg = gpusnap.Config(chunk_size=64 * 1024, copy_piece_bytes=256 * 1024, fast_slab_bytes=2 << 20,
                         memory_tier_dir=mount)
    small = {"w": torch.arange(100_000, dtype=torch.float32)}   # 400 kB: fits
    big = {"w": torch.arange(1_000_000, dtype=torch.float32)}   # 4 MB: 3 x does not fit in 8 MB
    with gpusnap.Checkpointer(durable, config=cfg) as ck:
        a = ck.save(small).wait()
        b = ck.save(big).wait()
        ck.wait()
    left = [os.path.join(d, f) for d, _s, fs in os.walk(mount) for f in fs]
    used = os.statvfs(mount)
    print(json.dumps({"a": [a.tier, a.stats["memory_tier"]], "b": [b.tier, b.stats["memory_tier"]],
                      "left_after_close": left,
                      "shm_used_bytes": (used.f_blocks - used.f_bfree) * used.f_frsize}))
    """
)


def test_memory_tier_turned_off_mid_run_is_removed_at_close(tmp_path: Path) -> None:
    mount = tmp_path / "mnt"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mount)], check=True)
    try:
        script = tmp_path / "small.py"
        script.write_text(SMALL)
        run = subprocess.run([sys.executable, str(script), str(mount), str(tmp_path / "durable")],
                             capture_output=True, text=True, timeout=300, check=False)
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout.strip().splitlines()[-1])
        print(json.dumps(out, indent=1))
        assert not out["left_after_close"], "close() left the memory tier's slabs in /dev/shm (host memory)"
    finally:
        subprocess.run(["umount", str(mount)], check=False)


KILLED = textwrap.dedent(
    """
    import os, signal, sys, torch, gpusnap
    sys.path.insert(0, sys.argv[2])
    from fast_support import make_state
    os.environ.pop("GPUSNAP_MEMORY_TIER", None)
    cfg = gpusnap.Config(chunk_size=64 * 1024, copy_piece_bytes=256 * 1024, fast_slab_bytes=2 << 20)
    ck = gpusnap.Checkpointer(sys.argv[1], config=cfg)
    ck.save(make_state(1)).wait()
    ck.wait()
    ck.save(make_state(2)).wait()    # the newest: only in the memory tier
    print(ck.list()[-1].id, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_after_sigkill_a_restart_without_the_memory_tier_sees_the_newest(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    newest = run_killed(tmp_path, KILLED, root)
    assert memory_tier_of(root).is_dir()
    # the restart (or `gpusnap list/restore ROOT`) with the memory tier off / refused
    with gpusnap.Checkpointer(root, config=gpusnap.Config(chunk_size=64 * 1024, memory_tier="off")) as ck:
        seen = [i.id for i in ck.list()]
        latest = ck.latest()
    print("newest left in the memory tier:", newest, "listed:", seen, "latest():", latest and latest.id)
    assert newest in seen, "the newest checkpoint (in the memory tier) is invisible: restore() silently takes an older one"


TERMED = textwrap.dedent(
    """
    import os, signal, sys, time, torch, gpusnap
    sys.path.insert(0, sys.argv[2])
    from fast_support import make_state
    os.environ.pop("GPUSNAP_MEMORY_TIER", None)
    cfg = gpusnap.Config(chunk_size=64 * 1024, copy_piece_bytes=256 * 1024, fast_slab_bytes=2 << 20)
    ck = gpusnap.Checkpointer(sys.argv[1], config=cfg, promote_every=10)
    print(ck.save(make_state(1)).wait().id, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)   # preemption: gpusnap's handler runs, then the default action
    time.sleep(30)
    """
)


def test_sigterm_names_what_stays_in_the_memory_tier_and_the_next_checkpointer_makes_it_durable(
        tmp_path: Path) -> None:
    root = tmp_path / "ck"
    script = tmp_path / "termed.py"
    script.write_text(TERMED)
    run = subprocess.run([sys.executable, str(script), str(root), str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=120, check=False)
    newest = run.stdout.split()[0]
    in_root = [p.stem for p in root.glob("manifests/*.json")]
    print("rc", run.returncode, "newest", newest, "in root", in_root, "tier left:", memory_tier_of(root).is_dir(),
          "stderr:", run.stderr[-300:])
    assert newest not in in_root and memory_tier_of(root).is_dir()  # (a signal handler starts nothing: it only waits)
    assert "stay in the memory tier" in run.stderr and "makes the newest durable" in run.stderr
    with gpusnap.Checkpointer(root, config=gpusnap.Config(chunk_size=64 * 1024)) as ck:
        assert newest in [i.id for i in ck.list()]
    assert newest in [p.stem for p in root.glob("manifests/*.json")]  # (close() adopted and promoted it)
