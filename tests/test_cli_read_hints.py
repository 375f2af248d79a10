"""The read commands' errors speak to someone reading: a directory that is not a checkpoint
root is a path to check (with the roots near it), not a directory to "pick" for a save; an
unknown checkpoint names the tags there are."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gpusnap
from gpusnap.cli.main import main

READS = [["ls"], ["show"], ["verify"], ["du"], ["diff", "a", "b"], ["gc", "--keep-last", "1"]]


def _argv(command: list[str], root: Path) -> list[str]:
    return [command[0], str(root), *command[1:]]


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpusnap: error: "), err
    return err


def _save(root: Path, *tags: str) -> None:
    with gpusnap.Checkpointer(root) as ckpt:
        for tag in tags:
            ckpt.save({"w": torch.zeros(4)}, tag=tag, blocking=True)


@pytest.mark.parametrize("command", READS, ids=lambda c: c[0])
def test_a_directory_of_other_files_is_a_path_to_check(tmp_path: Path, capsys, command: list[str]) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    assert main(_argv(command, tmp_path)) == 2
    err = _one_error_line(capsys)
    assert f"{tmp_path} is not a gpusnap checkpoint root" in err and "check the path" in err
    assert "pick" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # nothing made there


def test_the_roots_inside_the_directory_are_named(tmp_path: Path, capsys) -> None:
    _save(tmp_path / "run" / "ckpt", "best")
    (tmp_path / "run" / "log.txt").write_text("step 1")
    assert main(["ls", str(tmp_path / "run")]) == 2
    assert f"checkpoint roots inside it: {tmp_path / 'run' / 'ckpt'}" in _one_error_line(capsys)


def test_a_directory_inside_a_root_names_that_root(tmp_path: Path, capsys) -> None:
    _save(tmp_path / "ckpt", "best")
    assert main(["verify", str(tmp_path / "ckpt" / "manifests")]) == 2
    assert f"inside the checkpoint root {tmp_path / 'ckpt'}" in _one_error_line(capsys)


def test_an_unknown_checkpoint_names_the_tags_there_are(tmp_path: Path, capsys) -> None:
    _save(tmp_path / "ckpt", "step-700", "step-800")
    assert main(["show", str(tmp_path / "ckpt"), "step-500"]) == 2
    assert "tags: step-700, step-800" in _one_error_line(capsys)
