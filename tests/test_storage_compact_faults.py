"""Compaction is crash-safe in every order: a failure or a crash at each step of a gc that
compacts leaves every committed checkpoint restorable and verify-clean, and only garbage that
the next gc removes, ending where an undisturbed gc ends."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from fault_steps import StepFaultBackend
from faults import chunks_of, commit_checkpoint, small_config

import gpusnap.storage
from gpusnap.errors import StorageError
from gpusnap.kernels.hashing import chunk_digest
from gpusnap.storage import Repository
from gpusnap.storage.backend import LocalBackend


class _Crash(BaseException):
    """The process is gone: nothing after it runs (no cleanup reaches the disk)."""


class _CrashingBackend(StepFaultBackend):
    """Step ``fail_at`` and every mutating step after it never happen: what SIGKILL leaves."""

    def _step(self, kind: str, path: str) -> None:
        if self.failed is not None:
            raise _Crash(path)
        try:
            super()._step(kind, path)
        except OSError:
            raise _Crash(path) from None


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[bytes]]:
    """A root with two packs three quarters dead (one checkpoint needs a chunk of each) and
    the chunks that checkpoint names."""
    root = tmp_path_factory.mktemp("compact") / "ck"
    repo = Repository.open(root, create=True, config=small_config(io_threads=1))
    a = chunks_of(1, 8)
    old = commit_checkpoint(repo, [a], created=1.0)
    chunks = [a[0], a[4], *chunks_of(2, 4)]
    commit_checkpoint(repo, [chunks], created=2.0)
    repo.delete(old.id)
    return root, chunks


def _copy(base: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    shutil.copytree(base, root)
    return root


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "packs").rglob("*.pack"))}


@pytest.fixture(scope="module")
def clean(base: tuple[Path, list[bytes]], tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], dict[str, bytes]]:
    """Every step an undisturbed compaction takes, and the packs it ends with."""
    root = _copy(base[0], tmp_path_factory.mktemp("clean"))
    backend = StepFaultBackend(LocalBackend(root), removes=True)
    repo = Repository.open(root, backend=backend, config=small_config(io_threads=1))
    backend.arm(None)
    report = repo.gc()
    assert len(report.compacted_packs) == 2
    kinds = {s.kind for s in backend.steps}
    assert kinds == {"open_write", "write", "close", "makedirs", "rename", "sync_dir", "remove"}, kinds
    return list(backend.steps), _tree(root)


def _recovers(root: Path, chunks: list[bytes], ends_as: dict[str, bytes]) -> None:
    """Restorable and verify-clean now; the next gc leaves what an undisturbed one leaves."""
    repo = Repository.open(root, config=small_config(io_threads=1))
    assert [repo.read_chunk(chunk_digest(c)) for c in chunks] == chunks
    report = repo.verify()
    assert report.ok, report.problems
    after = repo.gc()
    assert after.problems == () and after.dead_bytes == 0
    assert os.listdir(root / "tmp") == []
    assert _tree(root) == ends_as
    assert Repository.open(root).verify().ok
    assert Repository.open(root, config=small_config(io_threads=1)).gc().compacted_packs == ()


def test_a_failure_at_each_step_of_compaction_is_raised_and_loses_nothing(
    base: tuple[Path, list[bytes]], clean: tuple[list[Any], dict[str, bytes]], tmp_path: Path
) -> None:
    steps, ends_as = clean
    for k, step in enumerate(steps):
        root = _copy(base[0], tmp_path / str(k))
        backend = StepFaultBackend(LocalBackend(root), removes=True)
        repo = Repository.open(root, backend=backend, config=small_config(io_threads=1))
        backend.arm(k)
        with pytest.raises(StorageError, match=r"^gc: .*No space left .*kept whole") as info:
            repo.gc()
        assert backend.failed is not None and backend.failed.kind == step.kind
        assert backend.describe(backend.failed.path) in str(info.value)  # names what failed
        _recovers(root, base[1], ends_as)


def test_a_crash_at_each_step_of_compaction_leaves_only_garbage(
    base: tuple[Path, list[bytes]], clean: tuple[list[Any], dict[str, bytes]], tmp_path: Path
) -> None:
    steps, ends_as = clean
    for k in range(len(steps) + 1):  # (the last: a crash right after the last step)
        root = _copy(base[0], tmp_path / str(k))
        backend = _CrashingBackend(LocalBackend(root), removes=True)
        repo = Repository.open(root, backend=backend, config=small_config(io_threads=1))
        backend.arm(k)
        try:
            repo.gc()
        except _Crash:
            pass
        _recovers(root, base[1], ends_as)


_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from fault_steps import StepFaultBackend
    from faults import small_config
    from gpusnap.storage import Repository
    from gpusnap.storage.backend import LocalBackend

    class Killing(StepFaultBackend):
        def _step(self, kind, path):
            if len(self.steps) == self.fail_at:
                os.kill(os.getpid(), signal.SIGKILL)
            self.steps.append((kind, path))

    backend = Killing(LocalBackend(sys.argv[1]), removes=True)
    repo = Repository.open(sys.argv[1], backend=backend, config=small_config(io_threads=1))
    backend.fail_at = int(sys.argv[2])
    repo.gc()
    """
)


@pytest.mark.parametrize("where", ["write", "rename", "remove"])
def test_sigkill_during_compaction_leaves_only_garbage(
    where: str, base: tuple[Path, list[bytes]], clean: tuple[list[Any], dict[str, bytes]], tmp_path: Path
) -> None:
    steps, ends_as = clean
    # mid-write of the new pack; right after it is published; after the first old pack went
    k = {"write": 2, "rename": [s.kind for s in steps].index("rename") + 1,
         "remove": [s.kind for s in steps].index("remove") + 1}[where]
    root = _copy(base[0], tmp_path)
    src = str(Path(gpusnap.storage.__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(Path(__file__).parent)])}
    child = subprocess.run([sys.executable, "-c", _CHILD, str(root), str(k)], env=env, capture_output=True)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()
    _recovers(root, base[1], ends_as)
