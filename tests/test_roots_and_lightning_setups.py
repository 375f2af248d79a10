"""Legitimate setups around private roots and the Lightning plug-in: parents made under umask
000, a fast root left by an older gpusnap, a root another user owns (a container's mounted
volume) or a group may write (refused, with the fix named), and a job killed during its
very first Lightning save then requeued."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fast_support import CFG, make_state

import gpusnap

TESTS = Path(__file__).parent
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")


def _python(code: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_under_umask_0_the_parents_gpusnap_makes_do_not_refuse_the_root(tmp_path: Path) -> None:
    """umask 000 (common in containers sharing a volume): the missing parents are made 0777 by
    ensure_private_dir's own os.makedirs, then refused as world-writable without a sticky bit."""
    root = tmp_path / "runs" / "exp1" / "ckpt"
    old = os.umask(0)
    try:
        with gpusnap.Checkpointer(root, config=CFG) as ck:
            ck.save(make_state(1)).wait()
    finally:
        os.umask(old)
    assert len(gpusnap.Checkpointer(root, config=CFG).list()) == 1


@as_root
def test_a_root_another_uid_owns_is_refused_with_the_container_fix_named(tmp_path: Path) -> None:
    """docker run -v $PWD/ckpt:/ckpt (host uid 1000, container uid 0): the root exists, owned
    by the host user. A root is one user's (docs/guarantees.md): refused, nothing written, and
    the error names what to do in a container."""
    root = tmp_path / "ckpt"
    root.mkdir(mode=0o755)
    os.chown(root, 1000, 1000)
    with gpusnap.Checkpointer(root, config=CFG) as ck:
        with pytest.raises(gpusnap.StorageError, match="owned by uid 1000") as error:
            ck.save(make_state(1), blocking=True)
    assert "docker run --user" in str(error.value) and "chown" in str(error.value)
    assert list(root.iterdir()) == []


def test_a_group_writable_root_is_refused_and_told_how_to_share_read_only(tmp_path: Path) -> None:
    """A team's root in a setgid project directory (drwxrws---): group members could plant links
    or read every checkpoint, so it is refused with the fix (chmod g-w keeps it readable by them)."""
    project = tmp_path / "project"
    project.mkdir()
    os.chmod(project, 0o2770)
    root = project / "ckpt"
    root.mkdir()
    os.chmod(root, 0o2770)
    with gpusnap.Checkpointer(root, config=CFG) as ck:
        with pytest.raises(gpusnap.StorageError, match="others may write it .mode 2770.") as error:
            ck.save(make_state(1), blocking=True)
    assert "chmod go-w" in str(error.value)
    os.chmod(root, 0o2750)  # shared for reading: the group reads, only the owner writes
    with gpusnap.Checkpointer(root, config=CFG) as ck:
        ck.save(make_state(1)).wait()


def test_a_fast_root_made_by_an_older_gpusnap_gets_private_slabs(tmp_path: Path) -> None:
    """An older gpusnap made slabs 0644 (root 0755): a save now reuses them, writes the new
    checkpoint's bytes into them, and they stay readable by every local user."""
    durable, fast = tmp_path / "durable", tmp_path / "shm" / "run1"
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        ck.save(make_state(1)).wait()
    slabs = sorted((fast / "slabs").iterdir())
    assert slabs
    for path in [fast, fast / "slabs", *slabs]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)  # what umask 022 gave before
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        for seed in range(2, 5):
            ck.save(make_state(seed)).wait()
    open_to_others = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in (fast / "slabs").iterdir()
                      if p.stat().st_mode & 0o077}
    assert not open_to_others, f"slabs holding this run's checkpoints are readable by others: {open_to_others}"


_KILL_AT_FIRST_RENAME = """
    import os, signal, sys, threading, torch
    def hook(event, args):
        if event == "os.rename" and threading.current_thread() is not threading.main_thread():
            os.kill(os.getpid(), signal.SIGKILL)  # the first checkpoint is not committed yet
    sys.addaudithook(hook)
    from gpusnap.integrations.lightning import GpusnapCheckpointIO
    io = GpusnapCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.zeros(1 << 16)}, "epoch": 0}, os.path.join(sys.argv[1], "last.ckpt"))
    io.wait()
    sys.exit("not killed")
"""


def test_lightning_a_preemption_during_the_first_save_leaves_nothing_to_resume(tmp_path: Path) -> None:
    """A requeued job always runs fit(ckpt_path="last"). Killed during its first save, before
    anything committed: last.ckpt must not look like a checkpoint (Lightning then starts from
    scratch, as it would without gpusnap), and the requeued fit runs."""
    pytest.importorskip("lightning")
    folder = tmp_path / "ckpts"
    folder.mkdir()
    killed = _python(_KILL_AT_FIRST_RENAME, str(folder))
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not (folder / "last.ckpt").exists()  # (a link to a manifest not committed: dangling)
    resumed = _python("""
        import sys, lightning_support as run
        trainer, _ = run.fit(sys.argv[1], ckpt_path="last", epochs=1)
        print(trainer.global_step)
    """, str(folder))
    assert resumed.returncode == 0, resumed.stderr[-1500:]
