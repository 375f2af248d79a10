"""The command line: ls, show, verify, gc, demo; errors are one line with a non-zero exit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

import gpusnap
from gpusnap.cli.main import main


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    model = nn.Linear(4, 3)
    with gpusnap.Checkpointer(root) as ck:
        ck.save({"model": model, "lr": 0.5, "name": "run"}, tag="first", blocking=True)
        ck.save({"model": model, "lr": 0.25, "name": "run"}, tag="second", blocking=True)
    return root


def test_ls_lists_committed_checkpoints(root, capsys):
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "first" in out and "second" in out and out.index("first") < out.index("second")


def test_show_prints_tensors_and_values(root, capsys):
    assert main(["show", str(root), "first"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()]
    assert ["model/weight", "float32", "3x4", "48", "B", "cpu"] in rows
    assert ["model/bias", "float32", "3", "12", "B", "cpu"] in rows
    assert "  lr = 0.5" in out and "  name = 'run'" in out


def test_verify_clean_is_zero(root, capsys):
    assert main(["verify", str(root)]) == 0
    assert capsys.readouterr().out.startswith("ok:")


def test_gc_keep_last(root, capsys):
    assert main(["gc", str(root), "--keep-last", "1"]) == 0
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "second" in out.splitlines()[-1] and "first" not in out.split("\n", 1)[1]


@pytest.mark.parametrize(
    "argv, code, needle",
    [
        (["ls", "/definitely/not/here"], 2, "no checkpoint root"),
        (["verify", "/definitely/not/here"], 2, "no checkpoint root"),
        (["show", "ROOT", "nope"], 2, "nope"),
        (["verify", "ROOT", "nope"], 2, "nope"),
        (["gc", "ROOT", "--keep-last", "0"], 2, "keep-last"),
    ],
)
def test_errors_are_one_line(root, capsys, argv, code, needle):
    argv = [str(root) if a == "ROOT" else a for a in argv]
    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpusnap: error:") and needle in err
    assert "Traceback" not in err


def test_usage_error_exits_2():
    proc = subprocess.run([sys.executable, "-m", "gpusnap", "verify"], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_python_dash_m_matches_console_script(root):
    proc = subprocess.run([sys.executable, "-m", "gpusnap", "ls", str(root)], capture_output=True, text=True)
    assert proc.returncode == 0 and "second" in proc.stdout


@pytest.mark.memory_tier
def test_demo_runs_and_proves_equality(tmp_path, capsys):
    assert main(["demo", "--root", str(tmp_path / "demo"), "--steps", "30", "--every", "5"]) == 0
    out = capsys.readouterr().out
    assert "restored state == state at that save (bitwise): yes" in out
    assert "resumed run == uninterrupted run (bitwise):     yes" in out
    assert "demo: OK" in out


@pytest.mark.memory_tier
def test_demo_keeps_its_root_and_says_how_to_look_at_it(tmp_path, capsys, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["demo", "--steps", "12", "--every", "4"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("the checkpoints are kept; look at them: gpusnap ls ")
    root = last.rsplit(" ", 1)[-1]
    assert root.startswith(str(tmp_path)) and main(["ls", root]) == 0
