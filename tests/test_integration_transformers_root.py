"""GpusnapCallback refuses a root its saves could not use when it is made, not at its first
save after ``save_steps`` steps of training; a usable root is accepted as before."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")

import gpusnap  # noqa: E402
from gpusnap.integrations.transformers import GpusnapCallback  # noqa: E402


def test_a_file_is_refused_at_construction(tmp_path):
    root = tmp_path / "ckpt"
    root.write_text("not a directory")
    with pytest.raises(gpusnap.CheckpointError, match=r"GpusnapCallback cannot save into .*ckpt.*a file"):
        GpusnapCallback(root, save_steps=2)


def test_a_directory_that_is_not_a_gpusnap_root_is_refused_at_construction(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "model.safetensors").write_bytes(b"someone else's")
    with pytest.raises(gpusnap.CheckpointError, match="not a gpusnap checkpoint root.*empty or new directory"):
        GpusnapCallback(root, save_steps=2)
    assert os.listdir(root) == ["model.safetensors"]  # left as it was


def test_a_root_that_cannot_be_created_is_refused_at_construction(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(gpusnap.StorageError, match="GpusnapCallback cannot save into"):
        GpusnapCallback(tmp_path / "file" / "ckpt", save_steps=2)  # under a file: no directory can be made


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="needs a user that permissions bind")
def test_an_unwritable_directory_is_refused_at_construction(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    root.chmod(0o555)
    try:
        with pytest.raises(gpusnap.StorageError, match="GpusnapCallback cannot save into.*Permission denied"):
            GpusnapCallback(root, save_steps=2)
    finally:
        root.chmod(0o755)


def test_a_new_path_an_empty_directory_and_a_root_are_accepted_and_a_new_root_is_made(tmp_path):
    (tmp_path / "empty").mkdir()
    with gpusnap.Checkpointer(tmp_path / "root") as ck:
        ck.save({"step": 1}).wait()
    for root in ("new", "new2/nested", "empty", "root"):
        GpusnapCallback(tmp_path / root, save_steps=2)
    for root in ("new", "new2/nested"):  # made now (its saves will find it), and empty
        assert (tmp_path / root).is_dir()
        with gpusnap.Checkpointer(tmp_path / root) as ck:
            assert ck.list() == []
    with gpusnap.Checkpointer(tmp_path / "root") as ck:
        assert len(ck.list()) == 1
