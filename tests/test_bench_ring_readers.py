"""benchmarks/ring_readers.py (issue 5's probe of reader processes): on the CPU the whole
pipeline runs (reader processes, the shared ring, slot reuse), so its bytes can be checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from bench_support import load_benchmark

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs os.memfd_create (Linux)")


@pytest.fixture()
def probe() -> Any:
    return load_benchmark("ring_readers")


@pytest.mark.parametrize("procs, part, slots", [(1, 1 << 20, 2), (3, 1 << 20, 4), (2, 3 << 19, 3)])
def test_ring_restore_copies_every_byte(probe: Any, tmp_path: Path, procs: int, part: int, slots: int) -> None:
    data = np.random.default_rng(procs).integers(0, 256, (7 << 20) + 12345, dtype=np.uint8)  # a short last piece
    path = tmp_path / "data"
    data.tofile(path)
    out = probe.ring_restore(str(path), torch.device("cpu"), procs, part, slots)
    assert out["exit_codes"] == [0] * procs
    assert np.array_equal(out["dst"].numpy(), data)
    assert probe.spot_check(str(path), out["dst"])


class _LateCopy:
    """A copy that runs only when its event is found done: after ``delay`` queries, or at
    ``synchronize()``, as an asynchronous copy to a device would. A slot read into again
    before its copy ran would show as wrong bytes in the result."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, delay: int) -> None:
        self.dst, self.src, self.left, self.done = dst, src, delay, False

    def _run(self) -> None:
        if not self.done:
            self.dst.copy_(self.src)
            self.done = True
            self.dst = self.src = None  # (the ring is unmapped at the end: hold no view of it)

    def query(self) -> bool:
        self.left -= 1
        if self.left <= 0:
            self._run()
        return self.done

    def synchronize(self) -> None:
        self._run()


@pytest.mark.parametrize("delay", [1, 3, 1000])
def test_slots_are_read_into_again_only_after_their_copy(probe: Any, tmp_path: Path, delay: int) -> None:
    data = np.random.default_rng(delay).integers(0, 256, 9 << 20, dtype=np.uint8)
    path = tmp_path / "data"
    data.tofile(path)
    events: list[_LateCopy] = []

    def late(dst: torch.Tensor, src: torch.Tensor) -> _LateCopy:
        events.append(_LateCopy(dst, src, delay))
        return events[-1]

    out = probe.ring_restore(str(path), torch.device("cpu"), 2, 1 << 20, 3, copy_slot=late)
    assert len(events) == 9 and all(e.done for e in events)
    assert np.array_equal(out["dst"].numpy(), data)


def test_a_reader_fails_on_a_short_read(probe: Any, tmp_path: Path) -> None:
    """Asked to read past the end of its file, a reader exits with an error."""
    path = tmp_path / "data"
    np.zeros(1 << 20, dtype=np.uint8).tofile(path)
    ring_fd = os.memfd_create("t")
    os.ftruncate(ring_fd, 1 << 20)
    cmd = (0).to_bytes(8, "little") + (2 << 20).to_bytes(8, "little") + (4096).to_bytes(8, "little")
    w = subprocess.run([sys.executable, probe.WORKER, str(path), str(ring_fd), str(1 << 20)],
                       input=cmd, capture_output=True, pass_fds=(ring_fd,), timeout=60, check=False)
    os.close(ring_fd)
    assert w.returncode != 0 and b"short read" in w.stderr


def test_a_dead_reader_fails_the_probe_instead_of_hanging(
        probe: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "data"
    np.zeros(1 << 20, dtype=np.uint8).tofile(path)
    dead = tmp_path / "dead.py"
    dead.write_text("import sys; sys.exit(3)\n")
    monkeypatch.setattr(probe, "WORKER", str(dead))
    monkeypatch.setattr(probe, "READ_TIMEOUT_S", 1.0)
    with pytest.raises(RuntimeError, match="reader failed to start: exit code 3"):
        probe.ring_restore(str(path), torch.device("cpu"), 2, 1 << 19, 2)
