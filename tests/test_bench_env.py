"""The bench's environment stamp: the source digest names the code that ran."""

from __future__ import annotations

import shutil
from pathlib import Path

import gpusnap
from gpusnap.bench.env import source_digest


def test_source_digest_follows_the_code_not_the_place(tmp_path: Path) -> None:
    package = Path(gpusnap.__file__).parent
    copy = tmp_path / "gpusnap"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    digest = source_digest(str(copy))
    assert digest == source_digest(str(package)) and len(digest) == 12
    (copy / "__pycache__").mkdir(exist_ok=True)
    (copy / "notes.txt").write_text("not code")
    assert source_digest(str(copy)) == digest  # only Python sources count
    target = copy / "bench" / "env.py"
    target.write_bytes(target.read_bytes() + b"\n# changed\n")
    assert source_digest(str(copy)) != digest
    target.rename(copy / "bench" / "env2.py")  # same bytes, another name
    changed = source_digest(str(copy))
    (copy / "bench" / "env2.py").rename(target)
    assert source_digest(str(copy)) != changed
