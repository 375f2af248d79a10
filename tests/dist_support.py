"""Multi-rank tests on CPU: each rank a fresh interpreter running a scenario of
``dist_workers.py``, joined by gloo through a FileStore (no port to pick). A scenario makes
its own assertions; a rank that fails exits non-zero and its output is shown. Only hang
guards are timeouts here: the ranks synchronize with barriers and the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("dist_workers.py")
HANG_S = 240.0  # a scenario that takes this long is hung: fail instead of blocking the suite


def run_ranks(scenario: str, world: int, where: Path, *, args: dict[str, Any] | None = None,
              killed: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world`` ranks; returns each surviving rank's result document.
    ``killed``: ranks expected to die by SIGKILL (the scenario kills them)."""
    where.mkdir(parents=True, exist_ok=True)
    store = where / f"store-{scenario}"
    store.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GPUSNAP_DIST_HANG_S=str(HANG_S - 30),
               PYTHONPATH=os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")]))
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), scenario, str(rank), str(world), str(store), str(where),
             json.dumps(args or {})],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=HANG_S)
            outputs.append(out.decode(errors="replace"))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        shown = "\n".join(f"--- rank {r}:\n{p.communicate()[0].decode(errors='replace')}" for r, p in enumerate(procs))
        raise AssertionError(f"{scenario} hung:\n{shown}") from None
    results = []
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        if rank in killed:
            assert proc.returncode == -9, f"rank {rank} was to be SIGKILLed, exit {proc.returncode}:\n{out}"
            continue
        assert proc.returncode == 0, f"{scenario}: rank {rank} exited {proc.returncode}:\n{out}"
        results.append(json.loads((where / f"{scenario}-{rank}.json").read_text()))
    return results
