"""``import gpusnap`` stays cheap: it does not import ``torch.distributed.tensor`` (over half
a second), which only a program that holds DTensors needs; DTensors made after gpusnap was
imported are still recognised."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          check=True, timeout=300).stdout.strip()


def test_import_gpusnap_does_not_import_dtensor() -> None:
    assert _run("import sys, gpusnap; print('torch.distributed.tensor' in sys.modules)") == "False"


def test_a_dtensor_made_after_the_import_is_recognised(tmp_path: Path) -> None:
    out = _run(f"""
        import torch, gpusnap
        from gpusnap.state.dtensor import is_dtensor
        before = is_dtensor(torch.zeros(2))
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        d = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
        print(before, is_dtensor(d), is_dtensor(torch.zeros(2)))
        dist.destroy_process_group()
    """)
    assert out.splitlines()[-1] == "False True False"
