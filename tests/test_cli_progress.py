"""Progress of the long commands (issue 24, item 5): ``gpusnap.export``, ``gpusnap.import_``
and ``Repository.gc``'s compaction tell their ``progress`` the total bytes once, then byte
counts summing to it; the CLI draws a bar from them on a terminal only."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from faults import any_root
from restore_support import tiny_config
from safetensors.torch import save_file
from test_storage_compact import _mostly_dead

import gpusnap
from gpusnap.cli import progress as cli_progress
from gpusnap.cli.main import main
from gpusnap.restore import eager
from gpusnap.storage import Repository


class Recorder:
    """A ``progress`` argument: the totals it was told, and every advance after them."""

    def __init__(self) -> None:
        self.totals: list[int] = []
        self.advances: list[int] = []

    def __call__(self, total: int) -> Callable[[int], None]:
        self.totals.append(total)
        return self.advances.append


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(40, 30), "w": torch.randn(3000), "step": 3}


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.fixture()
def saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, Any]]:
    # two 512-byte chunks per read task: many advances (the read size is no Config knob)
    monkeypatch.setattr(eager, "PIECE_BYTES", 1024)
    root = tmp_path / "ck"
    state = _state()
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        ck.save(state, blocking=True).wait()
    return root, state


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "dcp"])
def test_export_progress_sums_to_the_bytes_read(saved, tmp_path: Path, fmt: str) -> None:
    root, state = saved
    seen = Recorder()
    report = gpusnap.export(root, tmp_path / "out", format=fmt, progress=seen)
    model = state["model"]
    expected = _nbytes(model.weight, model.bias, state["w"])
    assert seen.totals == [expected] == [report.nbytes]
    assert sum(seen.advances) == expected and len(seen.advances) > 3


def test_export_progress_counts_only_the_selected_keys(saved, tmp_path: Path) -> None:
    root, state = saved
    seen = Recorder()
    gpusnap.export(root, tmp_path / "m.safetensors", format="safetensors", keys=["model"], progress=seen)
    expected = _nbytes(state["model"].weight, state["model"].bias)
    assert seen.totals == [expected] and sum(seen.advances) == expected


def test_export_with_progress_writes_what_export_without_it_writes(saved, tmp_path: Path) -> None:
    root, _state = saved
    gpusnap.export(root, tmp_path / "a.pt", format="torch")
    gpusnap.export(root, tmp_path / "b.pt", format="torch", progress=Recorder())
    a, b = (torch.load(tmp_path / n, weights_only=True) for n in ("a.pt", "b.pt"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))


def test_a_raising_export_progress_propagates_and_writes_nothing(saved, tmp_path: Path) -> None:
    root, _state = saved

    def start(total: int) -> Callable[[int], None]:
        def advance(n: int) -> None:
            raise KeyboardInterrupt

        return advance

    with pytest.raises(KeyboardInterrupt):
        gpusnap.export(root, tmp_path / "x.pt", format="torch", progress=start)
    assert not (tmp_path / "x.pt").exists()


def _weights(where: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    tensors = {"a": torch.randn(50, 40), "b": torch.arange(777, dtype=torch.int16), "c": torch.ones(3).double()}
    path = where / "w.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def test_import_progress_sums_to_the_bytes_committed(tmp_path: Path) -> None:
    path, tensors = _weights(tmp_path)
    seen = Recorder()
    info = gpusnap.import_(path, tmp_path / "ck", key="model", progress=seen, config=tiny_config())
    expected = _nbytes(*tensors.values())
    assert seen.totals == [expected] == [info.nbytes]
    assert sum(seen.advances) == expected and len(seen.advances) > 3  # one per 512-byte chunk

    again = Recorder()  # every chunk is already there: counted all the same
    gpusnap.import_(path, tmp_path / "ck", key="model", progress=again, config=tiny_config())
    assert again.totals == [expected] and sum(again.advances) == expected


class Stop(Exception):
    """A user's own error, raised by a progress callback."""


def test_a_raising_import_progress_raises_itself_once_and_commits_nothing(tmp_path: Path) -> None:
    path, _tensors = _weights(tmp_path)
    calls: list[int] = []

    def start(total: int) -> Callable[[int], None]:
        def advance(n: int) -> None:
            calls.append(n)
            if len(calls) == 2:
                raise Stop("cancelled")

        return advance

    with pytest.raises(Stop, match="cancelled"):  # the callback's own error, not a CheckpointError
        gpusnap.import_(path, tmp_path / "ck", key="model", progress=start,
                        config=dataclasses.replace(tiny_config(), io_threads=4))
    assert len(calls) == 2  # never called again once it raised, by any store task
    assert not (tmp_path / "ck").exists() or gpusnap.Checkpointer(tmp_path / "ck").list() == []


def test_export_of_a_corrupt_checkpoint_reports_no_bytes_past_the_failed_read(saved, tmp_path: Path) -> None:
    root, _state = saved
    pack = next(p for p in sorted((root / "packs").rglob("*")) if p.is_file())
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pack.write_bytes(bytes(data))
    seen = Recorder()
    with pytest.raises(gpusnap.IntegrityError):
        gpusnap.export(root, tmp_path / "x.pt", format="torch", progress=seen)
    assert sum(seen.advances) < seen.totals[0]
    assert not (tmp_path / "x.pt").exists()


def test_the_bar_leaves_stderr_alone(monkeypatch, capsys) -> None:
    import sys

    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    with cli_progress.byte_progress(100, "working") as advance:
        print("a warning", file=sys.stderr)  # (as logging's handler does meanwhile)
        advance(100)
    out, err = capsys.readouterr()
    assert "a warning" in err and "a warning" not in out


def test_import_progress_counts_shared_storage_once(tmp_path: Path) -> None:
    base = torch.randn(100)
    torch.save({"base": base, "view": base[10:20]}, tmp_path / "s.pt")
    seen = Recorder()
    gpusnap.import_(tmp_path / "s.pt", tmp_path / "ck", progress=seen)
    assert seen.totals == [base.nbytes] and sum(seen.advances) == base.nbytes


def test_gc_progress_sums_to_the_bytes_compaction_rewrites(tmp_path: Path) -> None:
    with any_root("local", tmp_path) as root:
        repo, _keep, _chunks = _mostly_dead(root)
        seen = Recorder()
        report = repo.gc(progress=seen)
        assert len(report.compacted_packs) == 2
        assert seen.totals == [report.rewritten_bytes] == [2 * 512] and seen.advances == [512, 512]
        idle = Recorder()
        assert repo.gc(progress=idle) == repo.gc()  # nothing to compact: progress is not called
        assert idle.totals == [] and idle.advances == []


def test_gc_without_compaction_never_calls_progress(tmp_path: Path) -> None:
    with any_root("local", tmp_path) as root:
        repo, _keep, _chunks = _mostly_dead(root)
        seen = Recorder()
        report = repo.gc(compact=False, progress=seen)
        assert report.compacted_packs == () and seen.totals == []


@contextmanager
def _fake_bar(calls: list[tuple[int, str, list[int]]]) -> Iterator[Callable[[int, str], Any]]:
    """A ``byte_progress`` that records its total, label and advances."""

    @contextmanager
    def byte_progress(total: int, label: str) -> Iterator[Callable[[int], None]]:
        advances: list[int] = []
        calls.append((total, label, advances))
        yield advances.append

    yield byte_progress


def test_the_cli_passes_a_bar_with_the_right_total(saved, tmp_path: Path, monkeypatch, capsys) -> None:
    root, state = saved
    calls: list[tuple[int, str, list[int]]] = []
    with _fake_bar(calls) as fake:
        monkeypatch.setattr(cli_progress, "byte_progress", fake)
        assert main(["export", str(root), "--format", "safetensors", "-o", str(tmp_path / "m.st"),
                     "--keys", "model"]) == 0
        model_bytes = _nbytes(state["model"].weight, state["model"].bias)
        assert [(t, label, sum(a)) for t, label, a in calls] == [(model_bytes, "exporting", model_bytes)]

        calls.clear()
        assert main(["import", str(tmp_path / "m.st"), str(tmp_path / "ck2"), "--key", "model"]) == 0
        assert [(t, label, sum(a)) for t, label, a in calls] == [(model_bytes, "importing", model_bytes)]

        with any_root("local", tmp_path / "gc") as gc_root:
            _mostly_dead(gc_root)
            calls.clear()
            capsys.readouterr()
            assert main(["gc", gc_root, "--json"]) == 0  # --json: no bar at all
            assert calls == [] and json.loads(capsys.readouterr().out)["rewritten_bytes"] == 1024
        with any_root("local", tmp_path / "gc2") as gc_root:
            _mostly_dead(gc_root)
            assert main(["gc", gc_root]) == 0
            assert [(t, label, sum(a)) for t, label, a in calls] == [(1024, "compacting", 1024)]


def test_off_a_terminal_the_commands_print_only_their_summaries(saved, tmp_path: Path, capsys) -> None:
    root, _state = saved
    assert main(["export", str(root), "--format", "torch", "-o", str(tmp_path / "all.pt")]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("exported checkpoint ") and out.count("\n") == 1 and err == ""

    assert main(["import", str(tmp_path / "all.pt"), str(tmp_path / "ck2")]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("imported ") and out.count("\n") == 1 and err == ""

    with any_root("local", tmp_path / "gc") as gc_root:
        _mostly_dead(gc_root)
        assert main(["gc", gc_root]) == 0
        out, err = capsys.readouterr()
        assert out.startswith("deleted 0 checkpoint(s)") and "compacted 2 mostly dead pack(s)" in out and err == ""
        assert "compacting" not in out and "\x1b" not in out and "\r" not in out


def test_on_a_terminal_a_bar_is_drawn_and_the_summary_still_printed(saved, tmp_path: Path, monkeypatch,
                                                                     capsys) -> None:
    root, _state = saved
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    assert main(["export", str(root), "--format", "torch", "-o", str(tmp_path / "all.pt")]) == 0
    out = capsys.readouterr().out
    assert "exporting" in out  # the bar, drawn on the terminal (then erased: transient)
    assert "exported checkpoint " in out
    with any_root("local", tmp_path / "gc") as gc_root:
        repo = _mostly_dead(gc_root)[0]
        assert main(["gc", gc_root]) == 0
        out = capsys.readouterr().out
        assert "compacting" in out and "compacted 2 mostly dead pack(s)" in out
        assert Repository.open(repo.root).verify().ok
