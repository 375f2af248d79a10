"""SIGKILL at an arbitrary moment of a save + gc loop leaves every committed checkpoint intact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from faults import small_config

import gpusnap.storage
from gpusnap.storage import Repository

_CHILD = textwrap.dedent(
    """
    import sys
    from faults import chunks_of, commit_checkpoint, small_config
    from gpusnap.storage import Repository

    repo = Repository.open(sys.argv[1], create=True, config=small_config(io_threads=2))
    i = 0
    while True:
        i += 1
        m = commit_checkpoint(repo, [chunks_of(i, 6), chunks_of(0, 2)])
        print(m.id, flush=True)  # printed only once commit() returned: durable and visible
        if i % 4 == 0:
            repo.gc(keep_last=3)
    """
)


def test_sigkill_during_saves_and_gc(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    src = str(Path(gpusnap.storage.__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(Path(__file__).parent)])}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(root)], stdout=subprocess.PIPE, env=env)
    seen: list[bytes] = []
    try:
        assert child.stdout is not None
        # a count of commits, not a time: three gcs ran, however slowly the machine goes; the
        # kill lands in the gc after the 12th commit or in a commit after it
        while len(seen) < 12:
            line = child.stdout.readline().strip()
            assert line, f"the child stopped after {len(seen)} commits"
            seen.append(line)
    finally:
        child.send_signal(signal.SIGKILL)
        out, _ = child.communicate()
    committed = [line.decode() for line in seen] + out.decode().split()
    assert len(committed) >= 8, committed

    repo = Repository.open(root, config=small_config())
    listed = {m.id for m in repo.list()}
    assert repo.problems() == []
    assert set(committed[-3:]) <= listed  # the newest three were never up for retention
    assert len(listed - set(committed)) <= 1  # at most the commit the kill interrupted after its rename
    report = repo.verify()
    assert report.ok, report.problems
    newest = repo.list()[-1]
    repo.gc(keep_last=1)  # whatever the crash left is garbage that gc clears
    assert list((root / "tmp").iterdir()) == []
    assert repo.verify().ok and repo.list() == [newest]
