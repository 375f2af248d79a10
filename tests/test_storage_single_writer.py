"""One writer per root: a second writer (another process, another Checkpointer, a gc) is
refused with an error naming the root and the writer, while readers keep working; a tag
names one checkpoint."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch

import gpusnap
from gpusnap import CheckpointError, Config, StorageError
from gpusnap.cli.main import main as cli_main
from gpusnap.storage import Manifest, Repository, fsspec_backend
from gpusnap.storage.repository import WriteTxn

CHILD = textwrap.dedent(
    """
    import sys, torch, gpusnap
    ck = gpusnap.Checkpointer(sys.argv[1], config=gpusnap.Config(chunk_size=4096, io_threads=1))
    ck.save({"t": torch.ones(1024)}, tag="child", blocking=True)
    print("ready", flush=True)
    sys.stdin.read()  # a writer until killed
    """
)


def _config() -> Config:
    return Config(chunk_size=4096, pack_size=64 * 1024, io_threads=2, staging_bytes=4096)


def test_a_second_process_is_refused_while_readers_work(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.Popen([sys.executable, str(script), str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        who = rf"another writer holds {root} .*pid {proc.pid} on host {socket.gethostname()}"
        state = {"t": torch.zeros(1024)}
        with gpusnap.Checkpointer(root, config=_config()) as ck:
            with pytest.raises(StorageError, match=who):
                ck.save(state)
            assert [i.tag for i in ck.list()] == ["child"]  # readers are not writers
            ck.restore(state)
            assert torch.equal(state["t"], torch.ones(1024))
        assert Repository.open(root).verify().ok
        assert cli_main(["ls", str(root)]) == 0 and cli_main(["verify", str(root)]) == 0
        other = Repository.open(root)
        with pytest.raises(StorageError, match=who):
            other.gc(keep_last=0, timeout=0.05)
        assert other.gc(keep_last=0, blocking=False).skipped and len(other.list()) == 1
    finally:
        proc.send_signal(signal.SIGKILL)  # the kernel releases its lease
        proc.wait()
    with gpusnap.Checkpointer(root, keep_last=1, config=_config()) as ck:
        ck.save({"t": torch.full((1024,), 2.0)}).wait()
        assert len(ck.list()) == 1


def test_a_second_checkpointer_in_one_process_is_refused_until_the_first_closes(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    state = {"t": torch.ones(1024)}
    first = gpusnap.Checkpointer(root, config=_config())
    second = gpusnap.Checkpointer(root, config=_config())
    try:
        first.save(state).wait()
        with pytest.raises(StorageError, match=rf"another writer holds {root} .*pid {os.getpid()}"):
            second.save(state)
        with pytest.raises(StorageError, match="another writer holds"):
            Repository.open(root).begin_write(timeout=0)
        assert len(second.list()) == 1
        second.restore(state)
    finally:
        first.close()
    try:
        second.save(state).wait()
        assert len(second.list()) == 2
    finally:
        second.close()


def test_a_tag_names_one_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ck"
    state = {"t": torch.ones(1024)}
    release = threading.Event()
    real_commit = WriteTxn.commit

    def commit(self: WriteTxn, manifest: Manifest) -> None:
        if manifest.tag == "slow":
            assert release.wait(60), "the test never released the commit"
        real_commit(self, manifest)

    monkeypatch.setattr(WriteTxn, "commit", commit)
    with gpusnap.Checkpointer(root, config=_config()) as ck:
        best = ck.save(state, tag="best").wait()
        with pytest.raises(CheckpointError, match=f"tag 'best' already names checkpoint {best.id}"):
            ck.save(state, tag="best")
        slow = ck.save(state, tag="slow")
        with pytest.raises(CheckpointError, match=f"tag 'slow' is taken by checkpoint {slow.id}, still being saved"):
            ck.save(state, tag="slow")
        release.set()
        slow.wait()
    with gpusnap.Checkpointer(root, config=_config()) as ck:
        with pytest.raises(CheckpointError, match="tag 'slow' already names"):
            ck.save(state, tag="slow")
        assert sorted(i.tag for i in ck.list()) == ["best", "slow"]


@pytest.fixture()
def memory_root() -> Iterator[str]:
    name = f"gpusnap-test-{uuid.uuid4().hex}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def _lease_object(root: str, **owner: object) -> None:
    fsspec.filesystem("memory").pipe_file(f"/{root.split('://', 1)[1]}/writer", json.dumps(owner).encode())


def test_an_object_store_lease_names_its_writer_and_expires(memory_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"t": torch.ones(256)}
    with gpusnap.Checkpointer(memory_root, config=_config()) as first:
        first.save(state).wait()
        with gpusnap.Checkpointer(memory_root, config=_config()) as second:
            with pytest.raises(StorageError, match=rf"another writer holds memory:///?{memory_root[9:]} .*pid {os.getpid()}"):
                second.save(state)
    # a writer of this host that is gone: its lease is stale at once
    _lease_object(memory_root, pid=2**31 - 1, host=socket.gethostname(), since=time.time(),
                  renewed=time.time(), token="dead")
    with gpusnap.Checkpointer(memory_root, config=_config()) as ck:
        ck.save(state).wait()
    # a writer on another host: live until LEASE_TTL_S after its last renewal
    now = time.time()
    _lease_object(memory_root, pid=1, host="elsewhere", since=now, renewed=now, token="remote")
    with gpusnap.Checkpointer(memory_root, config=_config()) as ck:
        with pytest.raises(StorageError, match="pid 1 on host elsewhere"):
            ck.save(state)
    # private: the lease clock; a Checkpointer opens its backend itself, so no clock argument reaches it
    monkeypatch.setattr(fsspec_backend, "_now", lambda: now + fsspec_backend.LEASE_TTL_S + 1)
    with gpusnap.Checkpointer(memory_root, config=_config()) as ck:
        ck.save(state).wait()
        # taken over meanwhile (it was idle past the TTL): its next commit is refused
        _lease_object(memory_root, pid=1, host="elsewhere", since=now, renewed=now + 2 * fsspec_backend.LEASE_TTL_S,
                      token="remote")
        with pytest.raises(StorageError, match="taken over by pid 1 on host elsewhere"):
            ck.save(state).wait()
        assert len(ck.list()) == 3
