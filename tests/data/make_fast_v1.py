"""Makes ``fast_v1.tar.gz``: a fast root whose manifests are of format version 1 (a chunk name
per chunk), written by gpusnap at commit 6cfe548, the last to write that format:

  git worktree add /tmp/v1 6cfe548 && PYTHONPATH=/tmp/v1/src python tests/data/make_fast_v1.py

Two checkpoints of :func:`v1_state` (the second changes ``b`` only, so its ``w`` names the
first one's chunks), tags ``one`` and ``two``. ``tests/test_fast_tier_format.py`` reads it.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile

import torch

import gpusnap


def v1_state(step: int) -> dict:
    """The fixture's state at ``step`` (exact values, no random numbers)."""
    return {"w": torch.arange(3000, dtype=torch.float32) * 0.5,
            "b": torch.arange(700, dtype=torch.float64) + step, "step": step}


CFG = dict(chunk_size=1024, copy_piece_bytes=4096, fast_slab_bytes=2 << 20, fsync=False)

if __name__ == "__main__":
    tmp = tempfile.mkdtemp()
    with gpusnap.Checkpointer(f"{tmp}/durable", fast_root=f"{tmp}/fast", config=gpusnap.Config(**CFG)) as ck:
        ck.save(v1_state(1), tag="one").wait()
        ck.save(v1_state(2), tag="two").wait()
    for name in ("lease", "lock", "tmp"):  # (the writer's; a reader makes its own)
        path = os.path.join(tmp, "fast", name)
        if os.path.isdir(path):
            shutil.rmtree(path)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fast_v1.tar.gz")
    with tarfile.open(out, "w:gz") as tar:
        tar.add(os.path.join(tmp, "fast"), arcname="fast")
    shutil.rmtree(tmp)
    print(out)
