"""Who may read a root: a fast root, a durable root and the files gpusnap makes in them are
this user's alone; a root another user could have planted, or could write, is refused before
any byte goes there, and no link in a root is followed to a file gpusnap writes."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from fast_support import CFG, make_state, roots

import gpusnap
from gpusnap.restore.via_server import paths

OTHER_UID = 65534  # nobody
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")

VICTIM_BYTES = (b"the victim's own data\n" * 100_000)[: CFG.fast_slab_bytes]  # (a slab's size: a save takes it)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _root_file(tmp_path: Path, tier: str) -> bytes:
    """The ``gpusnap.json`` of a real root of ``tier``: what a planter copies into a fake one."""
    durable, fast = roots(tmp_path / "model")
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        ck.save(make_state(1), promote=tier == "durable").wait()
    return ((fast if tier == "fast" else durable) / "gpusnap.json").read_bytes()


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM_BYTES)
    return victim


def _plant_fast_root(tmp_path: Path, victim: Path, *, mode: int = 0o777, uid: int | None = None) -> Path:
    """A fast root made ready by another user: open to all, ``slabs/000000.slab`` a link to
    the victim's file."""
    planted = tmp_path / "shm" / "run1"
    (planted / "slabs").mkdir(parents=True)
    (planted / "gpusnap.json").write_bytes(_root_file(tmp_path, "fast"))
    (planted / "slabs" / "000000.slab").symlink_to(victim)
    for d in (planted, planted / "slabs"):
        os.chmod(d, mode)
        if uid is not None:
            os.chown(d, uid, uid)
    return planted


def _refused_save(durable: Path, fast: Path | None, match: str) -> None:
    state = make_state(2)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        with pytest.raises(gpusnap.CheckpointError, match=match):
            ck.save(state).wait()


@pytest.mark.parametrize("owner", [None, pytest.param(OTHER_UID, marks=as_root)], ids=["open-to-all", "another-uid"])
def test_a_planted_fast_root_is_refused_and_the_victim_is_untouched(tmp_path: Path, owner: int | None) -> None:
    victim = _victim(tmp_path)
    planted = _plant_fast_root(tmp_path, victim, mode=0o777 if owner is None else 0o755, uid=owner)
    match = "only it may write: others may write it" if owner is None else f"owned by uid {OTHER_UID}"
    _refused_save(tmp_path / "durable", planted, match)
    assert victim.read_bytes() == VICTIM_BYTES
    assert not (planted / "manifests").exists() or not any((planted / "manifests").iterdir())


def test_the_refusal_says_how_to_fix_it(tmp_path: Path) -> None:
    planted = _plant_fast_root(tmp_path, _victim(tmp_path))
    with pytest.raises(gpusnap.StorageError) as err:
        with gpusnap.Checkpointer(tmp_path / "durable", fast_root=planted, config=CFG) as ck:
            ck.save(make_state(2)).wait()
    text = str(err.value)
    assert str(planted) in text and "mode 0777" in text and f"chmod go-w {planted}" in text


def _emptied_fast_root(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A fast root of ours that held a checkpoint, now deleted: the next save takes slab 0."""
    durable, fast = roots(tmp_path)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        ck.save(make_state(1)).wait()
    for manifest in (fast / "manifests").iterdir():
        manifest.unlink()
    return durable, fast, sorted((fast / "slabs").iterdir())[0]


def test_a_link_planted_in_our_own_fast_root_is_not_followed(tmp_path: Path) -> None:
    durable, fast, slab = _emptied_fast_root(tmp_path)
    victim = _victim(tmp_path)
    slab.unlink()
    slab.symlink_to(victim)
    _refused_save(durable, fast, "is a symbolic link")
    assert victim.read_bytes() == VICTIM_BYTES


@as_root
def test_a_slab_of_another_user_in_our_fast_root_is_refused(tmp_path: Path) -> None:
    durable, fast, slab = _emptied_fast_root(tmp_path)
    os.chown(slab, OTHER_UID, OTHER_UID)
    os.chmod(slab, 0o666)
    _refused_save(durable, fast, f"owned by uid {OTHER_UID}")


def test_a_fast_root_and_its_files_are_the_owners_alone(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        ck.save(make_state(1)).wait()
    with gpusnap.Checkpointer(durable, config=CFG) as ck:
        ck.save(make_state(2)).wait()
    for root in (fast, durable):
        assert _mode(root) == 0o700, root
        files = [p for p in root.rglob("*") if p.is_file()]
        assert files and {p.name: _mode(p) for p in files} == {p.name: 0o600 for p in files}, root
    assert list((fast / "slabs").iterdir()) and list((durable / "packs").rglob("*.pack"))


def _durable_root(tmp_path: Path) -> Path:
    durable = tmp_path / "ckpt"
    with gpusnap.Checkpointer(durable, config=CFG) as ck:
        ck.save(make_state(1)).wait()
    return durable


def _group_writable(root: Path) -> None:
    os.chmod(root, 0o770)


def _another_users(root: Path) -> None:
    os.chown(root, OTHER_UID, OTHER_UID)


@pytest.mark.parametrize(("spoil", "match"), [
    (_group_writable, "others may write it .mode 0770.; run chmod go-w"),
    pytest.param(_another_users, f"owned by uid {OTHER_UID}", marks=as_root),
], ids=["group-writable", "another-uid"])
def test_a_durable_root_others_may_write_or_own_is_refused(tmp_path: Path, spoil: Callable[[Path], None],
                                                           match: str) -> None:
    durable = _durable_root(tmp_path)
    victim = _victim(tmp_path)
    (durable / "writer").unlink()
    (durable / "writer").symlink_to(victim)  # (the lease file, rewritten by every writer)
    spoil(durable)
    _refused_save(durable, None, match)
    assert victim.read_bytes() == VICTIM_BYTES
    with gpusnap.Checkpointer(durable, config=CFG) as ck:  # reading is not refused
        assert len(ck.list()) == 1


def test_a_root_under_a_directory_anyone_may_rename_in_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # no sticky bit: another user could swap the root for theirs
    _refused_save(shared / "ckpt", None, f"anyone may rename entries of {shared}")
    os.chmod(shared, 0o1777)  # like /tmp and /dev/shm: fine, and so is a link of our own
    (tmp_path / "disk").mkdir(mode=0o700)
    (shared / "ckpt").symlink_to(tmp_path / "disk")
    with gpusnap.Checkpointer(shared / "ckpt", config=CFG) as ck:
        ck.save(make_state(1)).wait()
    assert (tmp_path / "disk" / "gpusnap.json").exists()


def test_a_socket_directory_under_a_directory_anyone_may_rename_in_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir()
    os.chmod(runtime, 0o777)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    with pytest.raises(PermissionError, match=f"anyone may rename entries of {runtime}.*XDG_RUNTIME_DIR"):
        paths.socket_path(tmp_path / "ck", create=True)
    os.chmod(runtime, 0o700)
    assert paths.socket_path(tmp_path / "ck", create=True).startswith(str(runtime))
    assert _mode(runtime / "gpusnap") == 0o700
