"""The fast tier's host memory is bounded by the state it holds, about (fast_keep_last + 2)
x the state, stated in each save's stats; a file system too small for that is a clear error
at prepare() or the first save that names the size needed, not a silent prepare()."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from fast_support import CFG, make_state, roots, run_on_small_tmpfs, train

import gpusnap


def _slab_bytes(fast: Path) -> int:
    return sum(p.stat().st_size for p in (fast / "slabs").iterdir())


@pytest.mark.parametrize("keep", [1, 2, 4])
def test_the_tiers_memory_follows_the_state_not_the_free_space(tmp_path: Path, keep: int) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(1, extra=1_000_000)  # ~4 MB
    nbytes = 0
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, fast_keep_last=keep) as ck:
        for step in range(2, 20):
            train(state, step)
            info = ck.save(state).wait()
            nbytes = info.nbytes
        ck.wait()
        cap = info.stats["fast_tier_cap_bytes"]
        assert info.stats["fast_tier_bytes"] == _slab_bytes(fast) <= cap
    per_save = nbytes + CFG.copy_piece_bytes + (2 << 20)  # a piece left at a slab's end, 2 MiB steps
    assert cap <= (keep + 2) * per_save, (cap, nbytes)


SMALL_SHM = textwrap.dedent(
    """
    import json, os, subprocess, sys, torch, gpusnap
    mount, durable = sys.argv[1], sys.argv[2]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", mount], check=True)
    fast = os.path.join(mount, "fast")
    cfg = gpusnap.Config(chunk_size=64 * 1024, copy_piece_bytes=256 * 1024, fast_slab_bytes=2 << 20)
    state = {"w": torch.arange(1_000_000, dtype=torch.float32), "step": 1}  # 4 MB: 4 of them need 16 MB
    out = {}
    with gpusnap.Checkpointer(durable, fast_root=fast, config=cfg, fast_keep_last=2) as ck:
        for name, call in (("prepare", lambda: ck.prepare(state, wait=True)), ("save", lambda: ck.save(state).wait())):
            try:
                call()
                out[name] = None
            except gpusnap.StorageError as exc:
                out[name] = str(exc)
        out["listed"] = [i.id for i in ck.list()]
    small = {"w": torch.arange(250_000, dtype=torch.float32), "step": 2}  # 1 MB: 3 of them fit
    with gpusnap.Checkpointer(durable, fast_root=fast, config=cfg, fast_keep_last=1) as ck:
        ck.prepare(small, wait=True)
        out["fits"] = ck.save(small).wait().tier
    print(json.dumps(out))
    """
)


def test_a_small_dev_shm_is_a_clear_error_at_prepare_and_first_save(tmp_path: Path) -> None:
    run = run_on_small_tmpfs(tmp_path, SMALL_SHM, str(tmp_path / "durable"))
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    for name in ("prepare", "save"):
        assert out[name] is not None and "needs" in out[name] and "fast_keep_last" in out[name], out
        assert "bytes free" in out[name], out
    assert out["listed"] == []
    assert out["fits"] == "fast"
