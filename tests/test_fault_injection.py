"""Fault injection, end to end: every fault a save can meet ends in an exception the program
sees (or a WARNING naming it), and every checkpoint committed before it restores bit-exactly.

- ENOSPC (and EIO) at each mutating step of a save, one run per step;
- a real full tmpfs (a 1 MiB tmpfs mounted in a private mount namespace);
- an S3-protocol object store (moto's server on 127.0.0.1) that goes away and comes back.
SIGKILL at random moments is in test_crash_sigkill.py and test_storage_crash.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from fault_steps import StepFaultBackend
from torch import nn

import gpusnap
from gpusnap import Config
from gpusnap.storage.backend import LocalBackend
from gpusnap.storage.repository import Repository

# one writer thread: a save then takes the same steps in the same order every time
CFG = Config(chunk_size=4096, pack_size=1 << 14, io_threads=1, staging_bytes=1 << 16)


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"model": nn.Linear(16, 16), "extra": torch.randn(5000), "step": seed}


def _copy_of(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": nn.Linear(16, 16), "extra": torch.zeros(5000), "step": -1}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a["step"] == b["step"]
        and torch.equal(a["extra"], b["extra"])
        and all(torch.equal(x, y) for x, y in zip(a["model"].state_dict().values(), b["model"].state_dict().values()))
    )


def _use_backend(monkeypatch: pytest.MonkeyPatch, backend: Any) -> None:
    real_open = Repository.open.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(
        Repository, "open", classmethod(lambda cls, root, **kw: real_open(cls, root, **{**kw, "backend": backend}))
    )


def _restores(root: Path, checkpoint: str | None, expected: dict[str, Any]) -> None:
    target = _copy_of(expected)
    with gpusnap.Checkpointer(root) as ck:
        ck.restore(target, checkpoint)
    assert _same(target, expected)


@pytest.fixture(scope="module")
def base_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """A root holding one committed checkpoint of ``_state(1)``."""
    root = tmp_path_factory.mktemp("fault-base") / "ck"
    with gpusnap.Checkpointer(root, config=CFG) as ck:
        cid = ck.save(_state(1)).wait().id
    yield root, cid


def _save_steps(base: Path, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The mutating steps a clean second save takes, from save() to its commit."""
    root = tmp / "probe"
    shutil.copytree(base, root)
    faulty = StepFaultBackend(LocalBackend(root))
    _use_backend(monkeypatch, faulty)
    with gpusnap.Checkpointer(root, config=CFG) as ck:
        faulty.arm(None)
        ck.save(_state(2)).wait()
        steps = list(faulty.steps)
    monkeypatch.undo()
    return steps


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_fault_at_each_step_of_a_save_is_raised_and_loses_nothing(
    base_root: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    base, first = base_root
    steps = _save_steps(base, tmp_path, monkeypatch)
    kinds = {s.kind for s in steps}
    assert {"open_write", "write", "close", "rename", "sync_dir"} <= kinds, steps
    for k, step in enumerate(steps):
        root = tmp_path / f"trial-{k}"
        shutil.copytree(base, root)
        faulty = StepFaultBackend(LocalBackend(root))
        _use_backend(monkeypatch, faulty)
        with gpusnap.Checkpointer(root, config=CFG) as ck:
            faulty.arm(k, code)
            with pytest.raises(gpusnap.StorageError, match=os.strerror(code)):
                ck.save(_state(2)).wait()  # raised by save() itself or by wait()
            assert faulty.failed is not None and faulty.failed.kind == step.kind, f"step {k} ({step}) not reached: {faulty.failed}"
            faulty.arm(None)
            assert [i.id for i in ck.list()] == [first], f"a failure at step {k} ({step}) left a visible checkpoint"
            third = ck.save(_state(3)).wait().id  # the next save works once the fault is gone
        monkeypatch.undo()
        assert not os.listdir(root / "tmp"), f"step {k} ({step}) left temporary files"
        _restores(root, first, _state(1))
        _restores(root, third, _state(3))
        assert Repository.open(root).verify().ok


FULL_TMPFS = textwrap.dedent(
    """
    import json, subprocess, sys, torch, gpusnap
    root = sys.argv[1]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", root], check=True)
    out = {}
    cfg = gpusnap.Config(chunk_size=4096, pack_size=1 << 16, io_threads=2, staging_bytes=1 << 16)
    small = {"w": torch.arange(1000, dtype=torch.float32), "step": 1}
    with gpusnap.Checkpointer(root + "/ck", config=cfg) as ck:
        first = ck.save(small).wait().id
        big = {"w": small["w"], "big": torch.randn(400_000), "step": 2}  # 1.6 MB > the 1 MiB tmpfs
        try:
            ck.save(big).wait()
            out["error"] = None
        except gpusnap.StorageError as exc:
            out["error"] = str(exc)
        out["listed"] = [i.id for i in ck.list()]
        small["step"] = 3
        out["again"] = ck.save(small).wait().id  # space is back once the big save is cleaned up
    target = {"w": torch.zeros(1000), "step": 0}
    with gpusnap.Checkpointer(root + "/ck") as ck:
        ck.restore(target, first)
        out["restored"] = bool(torch.equal(target["w"], torch.arange(1000, dtype=torch.float32))) and target["step"] == 1
        out["verify"] = gpusnap.storage.repository.Repository.open(root + "/ck").verify().ok
    out["first"] = first
    print(json.dumps(out))
    """
)


def _private_mount_namespace() -> list[str] | None:
    """A command prefix that runs a child in its own mount namespace (so it may mount a
    tmpfs), or None where the machine allows none."""
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    return ["unshare", "-rm"] if probe.returncode == 0 else None


def test_a_full_tmpfs_fails_the_save_clearly_and_the_next_one_works(tmp_path: Path) -> None:
    prefix = _private_mount_namespace()
    if prefix is None:
        pytest.skip("no private mount namespace here (unshare -rm) to mount a small tmpfs in")
    mount = tmp_path / "fs"
    mount.mkdir()
    script = tmp_path / "full.py"
    script.write_text(FULL_TMPFS)
    run = subprocess.run([*prefix, sys.executable, str(script), str(mount)], capture_output=True, text=True, timeout=300)
    if run.returncode != 0 and "mount" in run.stderr and "CalledProcessError" in run.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["error"] is not None and "No space left on device" in out["error"], out
    assert out["listed"] == [out["first"]]
    assert out["again"] and out["restored"] and out["verify"], out


# -- an object store that goes away --------------------------------------------------------


@pytest.fixture
def s3_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """moto's S3 server on 127.0.0.1 with one bucket; ``stop()``/``start()`` take it away
    and bring it back on the same port (its data lives in this process meanwhile)."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=url).create_bucket(Bucket="gpusnap-faults")
    state = {"server": server, "port": port}

    def stop() -> None:
        state["server"].stop()

    def start() -> None:
        state["server"] = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        state["server"].start()

    # few retries: a store that is gone should fail the save in seconds, not minutes
    options = {"client_kwargs": {"endpoint_url": url},
               "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5}}
    yield {"root": "s3://gpusnap-faults/run", "options": options, "stop": stop, "start": start}
    try:
        state["server"].stop()
    except Exception:
        pass


def test_an_object_store_that_goes_away_fails_the_save_and_loses_nothing(s3_store: dict[str, Any]) -> None:
    root, options = s3_store["root"], s3_store["options"]
    with gpusnap.Checkpointer(root, config=CFG, storage_options=options) as ck:
        first = ck.save(_state(1)).wait().id
        s3_store["stop"]()
        pending = ck.save(_state(2))
        with pytest.raises(gpusnap.StorageError):
            pending.wait()
        s3_store["start"]()
        assert [i.id for i in ck.list()] == [first]
        third = ck.save(_state(3)).wait().id
    # the failed save's store tasks still queued when it failed opened nothing afterwards
    # (a transaction nobody commits would leave its packs in tmp/ and hold the writer lease)
    fs = fsspec.filesystem("s3", **options)
    assert [p for p in fs.find(root) if "/tmp/" in p] == []
    for cid, seed in ((first, 1), (third, 3)):
        target = _copy_of(_state(seed))
        with gpusnap.Checkpointer(root, storage_options=options) as ck:
            ck.restore(target, cid)
        assert _same(target, _state(seed))
