"""Bad input gets a clear error and loses nothing committed."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import gpusnap
from gpusnap import CheckpointError, Config, RestoreMismatchError
from gpusnap.storage.repository import Repository

CFG = Config(chunk_size=4096, pack_size=1 << 16, io_threads=2, staging_bytes=4096)


def _committed(root: Path) -> tuple[str, dict]:
    app = {"model": nn.Linear(32, 32), "step": 5}
    with gpusnap.Checkpointer(root, config=CFG) as ck:
        cid = ck.save(app, blocking=True).wait().id
    return cid, app


def test_missing_root_is_a_clear_error(tmp_path):
    ck = gpusnap.Checkpointer(tmp_path / "nope")
    assert ck.list() == [] and ck.latest() is None
    with pytest.raises(gpusnap.CheckpointNotFoundError, match="nope"):
        ck.restore({"t": torch.zeros(1)})
    assert not (tmp_path / "nope").exists(), "restore must not create a root"


def test_unknown_id_names_what_exists(tmp_path):
    cid, app = _committed(tmp_path / "ck")
    with gpusnap.Checkpointer(tmp_path / "ck") as ck:
        with pytest.raises(gpusnap.CheckpointNotFoundError, match="no-such-id"):
            ck.restore(app, "no-such-id")


def test_wrong_shape_names_key_and_both_shapes_and_writes_nothing(tmp_path):
    _committed(tmp_path / "ck")
    target = {"model": nn.Linear(32, 16), "step": 0}
    before = {k: v.clone() for k, v in target["model"].state_dict().items()}
    with gpusnap.Checkpointer(tmp_path / "ck") as ck:
        with pytest.raises(RestoreMismatchError) as err:
            ck.restore(target)
    msg = str(err.value)
    assert "model" in msg and "weight" in msg and "32" in msg and "16" in msg
    for k, v in target["model"].state_dict().items():
        assert torch.equal(v, before[k])
    assert target["step"] == 0


def test_wrong_dtype_and_missing_key(tmp_path):
    _committed(tmp_path / "ck")
    with gpusnap.Checkpointer(tmp_path / "ck") as ck:
        with pytest.raises(RestoreMismatchError, match="float64"):
            ck.restore({"model": nn.Linear(32, 32).double(), "step": 0})
        with pytest.raises(RestoreMismatchError, match="step"):
            ck.restore({"model": nn.Linear(32, 32)})


def test_unsupported_value_fails_save_before_anything_is_written(tmp_path):
    class Opaque:
        pass

    root = tmp_path / "ck"
    cid, _ = _committed(root)
    with gpusnap.Checkpointer(root) as ck:
        with pytest.raises(CheckpointError, match="cfg"):
            ck.save({"t": torch.ones(1), "cfg": Opaque()})
        assert [i.id for i in ck.list()] == [cid]


@pytest.mark.parametrize("budget", [0, 3000, 40_000])
def test_full_disk_fails_the_save_and_keeps_earlier_checkpoints(tmp_path, monkeypatch, budget):
    from faults import FaultyBackend

    from gpusnap.storage.backend import LocalBackend

    root = tmp_path / "ck"
    cid, app = _committed(root)
    faulty = FaultyBackend(LocalBackend(root))
    real_open = Repository.open.__func__

    def open_faulty(cls, root_, **kw):
        kw["backend"] = faulty
        return real_open(cls, root_, **kw)

    monkeypatch.setattr(Repository, "open", classmethod(open_faulty))
    big = {"model": nn.Linear(32, 32), "step": 6, "extra": torch.randn(50_000)}
    with gpusnap.Checkpointer(root, config=CFG) as ck:
        faulty.write_budget = budget
        pending = ck.save(big)
        with pytest.raises(gpusnap.StorageError, match="(?i)no space"):
            pending.wait()
        with pytest.raises(gpusnap.StorageError):
            ck.save(big, blocking=True)
        faulty.write_budget = None
        assert [i.id for i in ck.list()] == [cid]
    monkeypatch.undo()
    assert not [p for p in (root / "tmp").iterdir()], "temporary files cleaned up"
    restored = {"model": nn.Linear(32, 32), "step": 0}
    with gpusnap.Checkpointer(root) as ck:
        ck.restore(restored)
        ck.save(big, blocking=True)  # once space is back, saving works again
        assert len(ck.list()) == 2
    assert restored["step"] == 5
    assert torch.equal(restored["model"].weight, app["model"].weight)
    assert Repository.open(root).verify().ok


def test_unreadable_files_are_a_clear_error_and_lose_nothing(tmp_path, monkeypatch):
    from faults import FaultyBackend

    from gpusnap.storage.backend import LocalBackend

    root = tmp_path / "ck"
    cid, app = _committed(root)
    faulty = FaultyBackend(LocalBackend(root))
    faulty.read_errno = errno.EACCES
    real_open = Repository.open.__func__
    monkeypatch.setattr(
        Repository, "open", classmethod(lambda cls, r, **kw: real_open(cls, r, **{**kw, "backend": faulty}))
    )
    target = {"model": nn.Linear(32, 32), "step": 0}
    before = target["model"].weight.detach().clone()
    with gpusnap.Checkpointer(root) as ck:
        with pytest.raises(CheckpointError, match="(?i)permission denied"):
            ck.restore(target, cid)
    assert torch.equal(target["model"].weight, before) and target["step"] == 0
    monkeypatch.undo()
    with gpusnap.Checkpointer(root) as ck:
        ck.restore(target, cid)
    assert torch.equal(target["model"].weight, app["model"].weight)


def test_second_checkpointer_on_same_root_during_saves(tmp_path):
    """One writer per root: a second Checkpointer saving while another one writes is refused
    (naming the writer), and every checkpoint of the first stays intact."""
    root = tmp_path / "ck"
    a, b = torch.zeros(20000), torch.ones(20000)
    errors: list[BaseException] = []

    def second_saver() -> None:
        try:
            with gpusnap.Checkpointer(root, keep_last=4, config=CFG) as ck:
                ck.save({"t": b}, tag="b0").wait()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    with gpusnap.Checkpointer(root, keep_last=4, config=CFG) as first:
        first.save({"t": a}, tag="a0").wait()
        thread = threading.Thread(target=second_saver)
        thread.start()
        for i in range(1, 6):
            a.add_(1)
            first.save({"t": a}, tag=f"a{i}").wait()
        thread.join()
    assert len(errors) == 1 and isinstance(errors[0], gpusnap.StorageError), errors
    assert f"another writer holds {root}" in str(errors[0])
    with gpusnap.Checkpointer(root) as ck:
        infos = ck.list()
        assert [info.tag for info in infos] == ["a2", "a3", "a4", "a5"]
        for info in infos:
            t = torch.empty(20000)
            ck.restore({"t": t}, info.id)
            assert torch.equal(t, torch.full((20000,), float(info.tag[1:]))), info.tag
    assert Repository.open(root).verify().ok


def test_second_save_while_one_is_pending(tmp_path):
    t = torch.zeros(1 << 15)
    with gpusnap.Checkpointer(tmp_path / "ck", config=CFG) as ck:
        pendings = []
        for i in range(5):
            t.fill_(i)
            pendings.append(ck.save({"t": t}, tag=f"s{i}"))
        infos = [p.wait() for p in pendings]
        assert [i.tag for i in ck.list()] == [f"s{i}" for i in range(5)]
        for info in infos:
            ck.restore({"t": t}, info.id)
            assert torch.equal(t, torch.full((1 << 15,), float(info.tag[1:])))


def test_save_after_close_is_refused(tmp_path):
    ck = gpusnap.Checkpointer(tmp_path / "ck")
    ck.close()
    with pytest.raises(CheckpointError, match="closed"):
        ck.save({"t": torch.zeros(1)})
