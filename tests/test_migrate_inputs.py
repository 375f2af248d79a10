"""Live migration's bad input: each mistake is a clear error before anything moves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_migrate import CFG

import gpusnap
from gpusnap.errors import RestoreMismatchError
from gpusnap.migrate import MigrationError, Source, Target, transport


def test_a_source_needs_a_mapping_and_a_config() -> None:
    with pytest.raises(TypeError, match="app_state must be a mutable mapping"):
        Source([torch.zeros(3)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config must be a gpusnap.Config"):
        Source({"w": torch.zeros(3)}, config={"chunk_size": 4096})  # type: ignore[arg-type]


def test_a_source_refuses_a_root_that_holds_something(tmp_path: Path) -> None:
    root = tmp_path / "used"
    with gpusnap.Checkpointer(root) as ckpt:
        ckpt.save({"w": torch.zeros(3)}).wait()
    with pytest.raises(ValueError, match="not empty: a migration's transport must be a new or empty root"):
        Source({"w": torch.zeros(3)}, root)


def test_a_root_given_to_the_source_is_made_private(tmp_path: Path) -> None:
    root = tmp_path / "transport"
    with Source({"w": torch.zeros(3)}, root, config=CFG) as src:
        assert src.address == str(root)
        assert root.stat().st_mode & 0o777 == 0o700


def test_a_target_needs_a_live_migration(tmp_path: Path) -> None:
    with pytest.raises(MigrationError, match="no migration at"):
        Target(tmp_path / "nothing")
    plain = tmp_path / "plain"
    with gpusnap.Checkpointer(plain) as ckpt:
        ckpt.save({"w": torch.zeros(3)}).wait()
    with pytest.raises(MigrationError, match="not a live migration's transport"):
        Target(plain)


def test_target_arguments_are_checked() -> None:
    with Source({"w": torch.zeros(3)}, config=CFG) as src:
        with pytest.raises(ValueError, match="verify must be"):
            Target(src.address, verify="sometimes")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="poll_s must be a positive number"):
            Target(src.address, poll_s=0)
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            Target(src.address, timeout=-1.0)
        with Target(src.address) as dst:
            with pytest.raises(TypeError, match="app_state must be a mutable mapping"):
                dst.receive([torch.zeros(3)])  # type: ignore[arg-type]


def test_one_target_at_a_time_and_one_receive_per_target() -> None:
    app = {"w": torch.arange(10.0)}
    with Source(app, config=CFG) as src:
        with Target(src.address) as dst:
            with pytest.raises(MigrationError, match="another target .* is receiving"):
                Target(src.address)
            src.handoff()
            copy = {"w": torch.zeros(10)}
            dst.receive(copy)
            with pytest.raises(MigrationError, match="has received already"):
                dst.receive(copy)
    assert torch.equal(copy["w"], app["w"])


def test_an_app_state_that_does_not_fit_is_refused_untouched() -> None:
    app = {"w": torch.arange(10.0), "b": torch.ones(4)}
    with Source(app, config=CFG) as src, Target(src.address) as dst:
        src.handoff()
        copy = {"w": torch.zeros(12), "b": torch.zeros(4)}
        with pytest.raises(MigrationError, match="(?s)does not fit the source.s state.*untouched") as caught:
            dst.receive(copy)
    assert isinstance(caught.value.__cause__, RestoreMismatchError)
    assert "w" in str(caught.value)
    assert torch.equal(copy["w"], torch.zeros(12)) and torch.equal(copy["b"], torch.zeros(4))


def _open_under(root: str) -> list[str]:
    """What this process's descriptors name under ``root``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # (closed meanwhile: the listing's own descriptor)
            continue
        if path.startswith(root + os.sep):
            found.append(path)
    return found


def test_a_target_that_fails_to_start_lets_go_of_its_lock_and_bell() -> None:
    with Source({"w": torch.arange(10.0)}, config=CFG) as src:
        claim = os.path.join(src.address, transport.TARGET_FILE)
        os.mkdir(claim)  # (its claim cannot be written: the last step of Target() fails)
        before = sorted(_open_under(src.address))
        with pytest.raises(OSError):
            Target(src.address)
        assert sorted(_open_under(src.address)) == before  # (the source's lock only)
        assert not [n for n in os.listdir(os.path.join(src.address, transport.MIGRATE)) if n.startswith("bell-")]
        os.rmdir(claim)
        with Target(src.address) as dst:  # not refused as "another target"
            src.handoff()
            copy = {"w": torch.zeros(10)}
            dst.receive(copy)
    assert torch.equal(copy["w"], torch.arange(10.0))
