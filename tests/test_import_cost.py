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


def test_import_gpusnap_imports_no_torch_until_a_name_is_used() -> None:
    out = _run("""
        import sys, gpusnap
        before = 'torch' in sys.modules
        gpusnap.Checkpointer
        print(before, 'torch' in sys.modules, sorted(set(gpusnap.__all__) - set(dir(gpusnap))))
    """)
    assert out == "False True []"


def test_an_unknown_name_is_an_attribute_error() -> None:
    import gpusnap

    try:
        gpusnap.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("gpusnap.no_such_name did not raise")


def test_the_command_line_builds_its_parser_without_torch() -> None:
    out = _run("""
        import sys, contextlib, io
        from gpusnap.cli.main import main
        with contextlib.redirect_stdout(io.StringIO()) as text:
            code = main(["--help"])
        print(code, 'torch' in sys.modules, 'export' in text.getvalue())
    """)
    assert out == "0 False True"


def test_export_formats_of_the_parser_are_the_exporters() -> None:
    from gpusnap.cli.interop_cmds import EXPORT_FORMATS
    from gpusnap.interop.exporter import FORMATS

    assert EXPORT_FORMATS == FORMATS


def test_first_uses_from_several_threads_at_once_all_succeed() -> None:
    out = _run("""
        import threading, torch, gpusnap
        names = [*gpusnap.__all__, "pool", "migrate"]
        start, errors = threading.Barrier(len(names)), []
        def use(name):
            start.wait()
            try:
                getattr(gpusnap, name)
            except Exception as exc:
                errors.append(f"{name}: {exc!r}")
        threads = [threading.Thread(target=use, args=(n,)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(errors)
    """)
    assert out == "[]"
