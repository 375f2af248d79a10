"""The command line as a new user meets it: --version, errors worded for a shell, permission
errors named as such, one exit-status scheme, a quiet broken pipe, a readable ``show`` with
``--stats`` and ``--json``, and ``ls`` marking an unreadable manifest."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import gpusnap
from gpusnap.cli import commands
from gpusnap.cli.main import main
from gpusnap.storage.backend import LocalBackend


def _state() -> dict:
    model = nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    return {
        "model": model,
        "optim": optim,
        "rng": gpusnap.RNGState(),
        "step": 3,
        "blob": b"x" * 5000,
        "seen": list(range(100)),
        "name": "run",
    }


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    state = _state()
    with gpusnap.Checkpointer(root) as ck:
        ck.save(state, tag="first").wait()  # concurrent: its stats hold the copier's timings
        state["step"] = 4
        ck.save(state, tag="second").wait()
    return root


def _ids(root: Path) -> list[str]:
    return sorted(p.stem for p in (root / "manifests").glob("*.json"))


def _one_error_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("gpusnap: error:"), err
    assert "Traceback" not in err
    return err


# -- --version ------------------------------------------------------------------------------------


def test_version_prints_the_package_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"gpusnap {gpusnap.__version__}"


# -- errors worded for a CLI user -----------------------------------------------------------------


@pytest.mark.parametrize("where", ["missing", "empty", "url"])
def test_missing_root_is_explained_without_library_arguments(tmp_path, capsys, where):
    if where == "missing":
        arg = str(tmp_path / "nothing")
    elif where == "empty":
        (tmp_path / "empty").mkdir()
        arg = str(tmp_path / "empty")
    else:
        arg = "memory://cli-reliability-nothing-here"
    assert main(["ls", arg]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert "no checkpoint root" in err and "create=True" not in err
    assert "first save of a gpusnap.Checkpointer" in err


def test_permission_denied_on_the_root_is_a_permission_error(root, capsys, monkeypatch):
    """``os.path.exists`` is False when ``stat`` fails with EACCES (a parent directory without
    search permission): that is not a missing root."""
    real_stat = os.stat
    denied = str(root)

    def stat(path, *args, **kwargs):
        if os.fspath(path).startswith(denied):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    for argv in (["ls", denied], ["show", denied], ["verify", denied]):
        assert main(argv) == 2
        err = _one_error_line(capsys.readouterr().err)
        assert "Permission denied" in err and "EACCES" in err, err
        assert "no checkpoint root" not in err


def _deny_manifest(monkeypatch, cid: str) -> None:
    real = LocalBackend.read_range

    def read_range(self, path, offset=0, length=None):
        if path == f"manifests/{cid}.json":
            raise PermissionError(errno.EACCES, "Permission denied", self.describe(path))
        return real(self, path, offset, length)

    monkeypatch.setattr(LocalBackend, "read_range", read_range)


def test_permission_denied_on_a_manifest_is_named(root, capsys, monkeypatch):
    first, second = _ids(root)
    _deny_manifest(monkeypatch, second)
    assert main(["show", str(root), second]) == 1
    err = capsys.readouterr().err
    assert second in err and "Permission denied" in err and "no checkpoint with id" not in err
    assert main(["show", str(root)]) == 0  # the newest readable one, and a warning saying so
    captured = capsys.readouterr()
    assert first in captured.out and "cannot be read" in captured.err and "newest readable" in captured.err


# -- exit statuses ----------------------------------------------------------------------------------


def test_help_documents_the_exit_statuses(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "exit status:" in out
    for code in ("0 ", "1 ", "2 ", "130", "141"):
        assert f"\n  {code}" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["gc", "ROOT", "--keep-last", "0"],  # bad argument value
        ["show", "ROOT", "nope"],  # unknown checkpoint
        ["ls"],  # argparse usage error
        ["ls", "ROOT", "--bogus"],
    ],
)
def test_usage_and_other_errors_exit_2(root, capsys, argv):
    assert main([str(root) if a == "ROOT" else a for a in argv]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_an_unexpected_exception_exits_2_not_1(root, capsys, monkeypatch):
    """1 means damage found: a bug in gpusnap must not read as a corrupt checkpoint."""

    def boom(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(commands, "cmd_ls", boom)
    assert main(["ls", str(root)]) == 2
    assert "internal error" in capsys.readouterr().err


def test_ctrl_c_exits_130(root, capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "cmd_verify", interrupted)
    assert main(["verify", str(root)]) == 130
    assert "interrupted" in _one_error_line(capsys.readouterr().err)


# -- ls marks an unreadable manifest ------------------------------------------------------------------


def test_ls_marks_an_unreadable_manifest_and_lists_the_rest(root, capsys):
    first, second = _ids(root)
    manifest = root / "manifests" / f"{second}.json"
    manifest.write_bytes(manifest.read_bytes()[:100])
    assert main(["ls", str(root)]) == 1
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert any(first in line and "first" in line for line in lines)
    (row,) = [line for line in lines if line.startswith("UNREADABLE")]
    assert str(manifest) in row and "truncated or corrupt" in row
    assert "cannot be read" in captured.err and "skip" in captured.err

    assert main(["ls", str(root), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [c["id"] for c in doc["checkpoints"]] == [first]
    assert doc["unreadable"] == [{"manifest": str(manifest), "error": doc["unreadable"][0]["error"]}]
    assert "truncated or corrupt" in doc["unreadable"][0]["error"]


def test_show_of_a_corrupt_manifest_exits_1(root, capsys):
    _first, second = _ids(root)
    manifest = root / "manifests" / f"{second}.json"
    manifest.write_bytes(manifest.read_bytes()[:100])
    assert main(["show", str(root), second]) == 1
    err = _one_error_line(capsys.readouterr().err)
    assert second in err and "truncated or corrupt" in err


def test_verify_json(root, capsys):
    assert main(["verify", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "gpusnap.verify/1" and doc["ok"] is True and doc["problems"] == []
    assert doc["checked_checkpoints"] == 2 and doc["checked_bytes"] > 0
    _first, second = _ids(root)
    manifest = root / "manifests" / f"{second}.json"
    manifest.write_bytes(manifest.read_bytes()[:100])
    assert main(["verify", str(root), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and any(second in p for p in doc["problems"])


# -- a closed pipe ------------------------------------------------------------------------------------


def test_show_into_a_closed_pipe_exits_quietly(root):
    """``gpusnap show ROOT | head -1`` when head is gone before show writes: the shell waits
    for a line on stdin, so the pipe's reader is closed first, whatever the machine's load."""
    proc = subprocess.Popen(
        ["sh", "-c", 'read _; exec "$0" -m gpusnap show "$1"', sys.executable, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # the reader goes away
    proc.stdin.write(b"go\n")
    proc.stdin.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == "", err


# -- show: a readable summary, --stats, --json -----------------------------------------------------------


def test_show_is_a_readable_summary(root, capsys):
    assert main(["show", str(root), "first"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) < 60, out
    head = {line.split()[0]: line.split(None, 1)[1] for line in lines[1:] if line.startswith("  ") and line.split()}
    assert head["tag"] == "first" and head["stall"].endswith("in save())") and "validation" in head
    assert "copier_s" not in out and "save_phases_s" not in out  # internals: --stats
    assert any(line.split()[:4] == ["model/weight", "float32", "3x4", "48"] for line in lines), out
    assert any(line.split()[:3] == ["optim/state/0/exp_avg_sq", "float32", "3x4"] for line in lines)
    assert "  rng/python = (3, <625 ints>, None)" in lines
    assert "  blob = <bytes 4.9 KiB>" in lines
    assert "  seen = <100 ints>" in lines
    assert "  optim/param_groups/0/lr = 0.001" in lines
    assert "  step = 3" in lines and "  name = 'run'" in lines


def test_show_stats_lists_every_stat(root, capsys):
    assert main(["show", str(root), "first", "--stats"]) == 0
    out = capsys.readouterr().out
    assert "copier_s." in out and "save_phases_s.flatten" in out and "stall_s" in out
    assert len(out.splitlines()) < 150


def test_show_json_has_everything(root, capsys):
    assert main(["show", str(root), "second", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "gpusnap.show/1" and doc["tag"] == "second"
    for key in ("id", "created", "created_utc", "nbytes", "chunk_size", "storages", "stats", "tree", "values"):
        assert key in doc
    tensors = {t["key"]: t for t in doc["tensors"]}
    assert tensors["model/weight"] == {
        "key": "model/weight",
        "dtype": "float32",
        "shape": [3, 4],
        "nbytes": 48,
        "device": "cpu",
        "requires_grad": True,
    }
    values = {v["key"]: v for v in doc["values"]}
    assert values["step"] == {"key": "step", "kind": "v", "text": "4"}
    assert "copier_s" in doc["stats"] and doc["stall_s"] == doc["stats"]["stall_s"]


def test_ls_json(root, capsys):
    assert main(["ls", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "gpusnap.ls/1" and doc["unreadable"] == []
    assert [c["tag"] for c in doc["checkpoints"]] == ["first", "second"]
    assert set(doc["checkpoints"][0]) == {
        "id", "tier", "tag", "created", "created_utc", "nbytes", "stall_s", "duration_s", "validation",
    }
    assert {c["tier"] for c in doc["checkpoints"]} == {"durable"}
