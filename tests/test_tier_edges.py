"""Edges of the fast tier's promotion, SIGTERM and fork handling: a program's SIGTERM handler
that chains the one it found (as Lightning's does), fast saves during a durable outage,
close() in a forked child, a promotion failing at exit in a program that logs to a file,
and the durable root spelled as a file URL."""

from __future__ import annotations

import errno
import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from fast_support import CFG, HANG_S, durable_backend, make_state, roots, train
from faults import FaultyBackend

import gpusnap
from gpusnap.storage.backend import LocalBackend
from gpusnap.storage.repository import Repository

TESTS = os.path.dirname(os.path.abspath(__file__))

# Lightning's _SignalConnector (trainer/connectors/signal_connector.py) does this: note the
# signal, then call the handler that was there before (when it is not SIG_DFL)
CHAINING = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, sys.argv[2])
    from fast_support import CFG, make_state, train
    import gpusnap
    state = make_state(1)
    ck = gpusnap.Checkpointer(sys.argv[1], config=CFG)
    stop = []
    previous = signal.getsignal(signal.SIGTERM)
    def graceful(signum, frame):
        stop.append(signum)
        if callable(previous):
            previous(signum, frame)
    signal.signal(signal.SIGTERM, graceful)
    for step in range(100):
        train(state, step)
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # preemption
        if stop:
            ck.save(state, tag="final", blocking=True)
            break
    ck.close()
    print("graceful", flush=True)
    """
)


def test_a_program_handler_that_chains_the_previous_sigterm_handler_still_shuts_down_gracefully(
    tmp_path: Path,
) -> None:
    script = tmp_path / "job.py"
    script.write_text(CHAINING)
    run = subprocess.run([sys.executable, str(script), str(tmp_path / "root"), TESTS],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0 and "graceful" in run.stdout, (run.returncode, run.stderr[-2000:])
    assert [m.tag for m in Repository.open(tmp_path / "root").list()] == ["final"]


class _Full(FaultyBackend):
    """A durable root whose disk is full (every pack write fails)."""

    def open_write(self, path: str) -> Any:
        if path.endswith(".pack"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return super().open_write(path)


def test_fast_saves_go_on_while_the_durable_root_is_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    durable, fast = roots(tmp_path)
    durable_backend(monkeypatch, durable, _Full(LocalBackend(durable)))
    state = make_state(1, extra=400_000)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, fast_keep_last=1) as ck:
        for step in range(2, 12):  # each asks for promotion; each promotion fails (disk full)
            train(state, step)
            ck.save(state, promote=True).wait()  # the fast tier itself has room: the save must not fail
        with pytest.raises(gpusnap.StorageError, match="promoting"):
            ck.wait()  # the promotion failures are raised here, as documented


def _child_returns(work: Any) -> bool:
    """Whether ``work`` returns (or raises) in a forked child within HANG_S."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            try:
                work()
            except BaseException:  # noqa: BLE001 (an error is an answer too)
                pass
            os.write(write, b"x")
        finally:
            os._exit(0)
    os.close(write)
    try:
        ready, _w, _x = select.select([read], [], [], HANG_S)
        returned = bool(ready) and os.read(read, 1) == b"x"
    finally:
        os.close(read)
        if not returned:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return returned


@pytest.mark.parametrize("fast", [False, True], ids=["durable", "fast"])
def test_close_in_a_forked_child_returns_or_raises(tmp_path: Path, fast: bool) -> None:
    durable, fast_root = roots(tmp_path)
    with gpusnap.Checkpointer(durable, fast_root=fast_root if fast else None, config=CFG) as ck:
        ck.save(make_state(1)).wait()  # the writer thread exists (waiting for the next save)
        assert _child_returns(ck.close), "Checkpointer.close() in a forked child hung"


EXIT_SCRIPT = textwrap.dedent(
    """
    import errno, logging, os, sys
    sys.path.insert(0, sys.argv[2])
    from pathlib import Path
    from fast_support import CFG, make_state
    from faults import FaultyBackend
    import gpusnap
    from gpusnap.storage.backend import LocalBackend
    from gpusnap.storage.repository import Repository
    class Full(FaultyBackend):
        def open_write(self, path):
            if path.endswith(".pack"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
            return super().open_write(path)
    tmp = Path(sys.argv[1]); durable, fast = tmp / "durable", tmp / "fast"
    full = Full(LocalBackend(durable)); full.local_path = full.inner.local_path
    real = Repository.open.__func__
    def open_(cls, root, **kw):
        if os.fspath(root) == os.fspath(durable):
            kw["backend"] = full
        return real(cls, root, **kw)
    Repository.open = classmethod(open_)
    logging.basicConfig(filename=str(tmp / "train.log"))  # the program logs to a file
    ck = gpusnap.Checkpointer(durable, fast_root=fast, config=CFG)
    print(ck.save(make_state(1), tag="final", promote=True).id, flush=True)
    """
)


def test_a_promotion_that_fails_at_exit_is_named_on_stderr(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(EXIT_SCRIPT)
    run = subprocess.run([sys.executable, str(script), str(tmp_path), TESTS],
                         capture_output=True, text=True, timeout=300, check=False)
    checkpoint_id = run.stdout.strip().splitlines()[-1]
    assert not list((tmp_path / "durable" / "manifests").glob("*.json"))  # not promoted
    assert checkpoint_id in run.stderr, (run.returncode, run.stderr)  # as a save lost at exit is


def test_the_durable_root_spelled_as_a_file_url_still_owns_its_fast_root(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        saved = ck.save(make_state(1)).wait()
    with gpusnap.Checkpointer(f"file://{durable}", fast_root=fast, config=CFG) as ck:
        assert ck.latest().id == saved.id  # type: ignore[union-attr]
