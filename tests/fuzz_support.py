"""Model-based fuzzing support (tests/test_model_fuzz.py): the fuzzed program's state, a
blank one to restore into, a durable root whose backend fails or holds writes on demand, and
a forked child with a bounded wait.

The state is a few KiB on the CPU but has what real ones have: a model with tied weights, its
optimizer (with state), a plain tensor whose storage the program frees or resizes, a base
tensor reached through views (one non-contiguous), and plain values.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from fast_support import same, snapshot
from faults import HANG_S, FaultyBackend
from torch import nn

from gpusnap.storage.backend import LocalBackend
from gpusnap.storage.layout import ROOT_FILE
from gpusnap.storage.repository import Repository

__all__ = [
    "CHILD_EXIT_S",
    "DurableBackend",
    "blank_for",
    "durable_backends",
    "fork_child",
    "load_snapshot",
    "make_state",
    "write",
]

WIDTH = 8
BASE = 256  # elements of the tensor the views share
CHILD_EXIT_S = 60.0  # a forked child doing a few tiny tensor ops: more is a hang


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
    model[2].weight = model[0].weight  # tied: two keys, one storage
    return model


def _views(base: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"head": base[:64], "t": base[64:128].view(WIDTH, WIDTH).t(), "tail": base[200:]}


def make_state(seed: int, x_len: int) -> dict[str, Any]:
    """The fuzzed program's state, its optimizer one step in (so that it has state)."""
    model = _model(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    base = torch.randn(BASE)
    state: dict[str, Any] = {"model": model, "optim": optim, "x": torch.randn(x_len), "base": base,
                             "views": _views(base), "step": 0, "name": "s0", "blob": b"\0" * 8, "lr": 0.5}
    write(state, "train", 1)
    return state


def blank_for(expected: dict[str, Any]) -> dict[str, Any]:
    """A state of the structure of the snapshot ``expected`` whose every value differs (a
    fresh process's); its optimizer has taken no step."""
    model = _model(999_999)
    base = torch.full((BASE,), 7.0)
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2),
            "x": torch.full(expected["x"].shape, 7.0), "base": base, "views": _views(base),
            "step": -1, "name": "", "blob": b"", "lr": -1.0}


def load_snapshot(state: dict[str, Any], expected: dict[str, Any]) -> None:
    """Make ``state`` (a shadow, which gpusnap never sees) hold the snapshot ``expected``: what
    restoring its checkpoint into it gives."""
    model = state["model"]
    model.load_state_dict({k: expected[f"model/{k}"] for k in model.state_dict()})
    state["optim"].load_state_dict(_rebuild(state["optim"].state_dict(), "optim", expected))
    state["x"] = expected["x"].clone()
    state["base"].copy_(expected["base"])
    for key in ("step", "name", "blob", "lr"):
        state[key] = expected[key]


def _rebuild(template: Any, path: str, expected: dict[str, Any]) -> Any:
    """``template``'s structure with the leaves of ``expected`` (a snapshot) at its paths."""
    if isinstance(template, dict):
        return {k: _rebuild(v, f"{path}/{k}", expected) for k, v in template.items()}
    if isinstance(template, (list, tuple)):
        return type(template)(_rebuild(v, f"{path}/{i}", expected) for i, v in enumerate(template))
    value = expected[path]
    return value.clone() if isinstance(value, torch.Tensor) else value


def write(state: dict[str, Any], kind: str, k: int) -> None:
    """One in-place write of ``kind`` (``k`` varies the values), as a training loop makes."""
    model, x, views = state["model"], state["x"], state["views"]
    with torch.no_grad():
        if kind == "train":  # forward, backward and an optimizer step: parameters and moments
            with torch.enable_grad():
                inp = torch.linspace(-1.0, 1.0, 4 * WIDTH).view(4, WIDTH) * k
                model(inp).square().sum().backward()
            state["optim"].step()
            state["optim"].zero_grad()
        elif kind == "tied":  # through the second name of the tied weight
            model[2].weight.mul_(0.5).add_(k)
        elif kind == "x":
            x.add_(k)
        elif kind == "x_slice":
            x[k % max(1, x.numel()):].fill_(k)
        elif kind == "view":  # through a view: the base changes
            views["head"].add_(k)
        elif kind == "view_t":  # through a non-contiguous view
            views["t"][k % WIDTH].fill_(-k)
        elif kind == "base":
            state["base"].mul_(-1.0)
        elif kind == "plain":
            state["step"] += k
            state["name"] = f"s{state['step']}"
            state["blob"] = bytes([k % 256]) * (k % 5 + 1)
            state["lr"] = state["lr"] / 2
        else:
            raise ValueError(kind)


class DurableBackend(FaultyBackend):
    """The durable root's backend: one-shot full-disk faults, and a gate that holds the
    files a background (promotion) thread writes until released.

    Only threads other than the ``driver`` threads are held, so a test never blocks on its
    own gate directly; :meth:`watchdog` releases it when a driver call waits for a held one."""

    def __init__(self, root: Path) -> None:
        super().__init__(LocalBackend(root))
        self.local_path = self.inner.local_path  # type: ignore[attr-defined]
        self.driver: set[int] = {threading.get_ident()}
        self._lock = threading.Lock()
        self._shots: list[str] = []  # armed one-shot faults: "open" or "rename"
        self.fired: list[tuple[str, bool]] = []  # (what, on a driver thread)
        self._gate: threading.Event | None = None
        self.write_errno = errno.ENOSPC
        self.rename_errno = errno.ENOSPC
        self.fail_open_write = lambda path: self._shoot("open")
        self.fail_rename = lambda path: self._shoot("rename")

    def arm(self, what: str) -> None:
        """The next ``what`` (``"open"``: a file opened for writing, ``"rename"``: a commit's
        rename) fails with ENOSPC, once (arming it again before it fired changes nothing)."""
        with self._lock:
            if what not in self._shots:
                self._shots.append(what)

    def _shoot(self, what: str) -> bool:
        with self._lock:
            if what not in self._shots:
                return False
            self._shots.remove(what)
            self.fired.append((what, threading.get_ident() in self.driver))
            return True

    def hold(self) -> None:
        """Hold every transaction file a background thread opens, until :meth:`release`."""
        with self._lock:
            if self._gate is None:
                self._gate = threading.Event()

    def holding(self) -> bool:
        with self._lock:
            return self._gate is not None

    def release(self) -> None:
        with self._lock:
            gate, self._gate = self._gate, None
        if gate is not None:
            gate.set()

    @contextmanager
    def watchdog(self, grace_s: float) -> Iterator[None]:
        """Release the gate if the block takes more than ``grace_s`` (it waits for a held write)."""
        if not self.holding():
            yield
            return
        timer = threading.Timer(grace_s, self.release)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    def open_write(self, path: str) -> Any:
        in_txn = "/" in path and ROOT_FILE not in path  # (opening the root, which may make it, is never held)
        with self._lock:
            gate = self._gate if threading.get_ident() not in self.driver and in_txn else None
        if gate is not None and not gate.wait(HANG_S):
            raise TimeoutError("the durable gate was never released")
        return super().open_write(path)


@contextmanager
def durable_backends() -> Iterator[dict[str, DurableBackend]]:
    """While open, ``Repository.open`` of a root named in the yielded mapping (path ->
    backend) goes through that backend, as tests/test_fast_tier_faults.py injects faults."""
    backends: dict[str, DurableBackend] = {}
    real_open = Repository.open.__func__  # type: ignore[attr-defined]

    def open_(cls: Any, root: Any, **kw: Any) -> Any:
        backend = backends.get(os.fspath(root)) if isinstance(root, (str, os.PathLike)) else None
        if backend is not None and kw.get("backend") is None:
            kw["backend"] = backend
        return real_open(cls, root, **kw)

    Repository.open = classmethod(open_)  # type: ignore[method-assign, assignment]
    try:
        yield backends
    finally:
        Repository.open = classmethod(real_open)  # type: ignore[method-assign, assignment]


def fork_child(state: dict[str, Any], shadow: dict[str, Any], k: int) -> tuple[int, str]:
    """Fork a child that reads the state (it must equal ``shadow``), writes it in place,
    reads it back, and exits; returns its exit status and what it said went wrong. A child
    that does not exit within :data:`CHILD_EXIT_S` is killed (-9)."""
    expected = snapshot(shadow)
    read, write_fd = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (multi-threaded parent: that is the point)
        pid = os.fork()
    if pid == 0:  # the child: never returns into the test
        code = 3
        try:
            os.close(read)
            wrong = same(snapshot(state), expected)
            msg = f"read {wrong}" if wrong else ""
            if not msg:
                write(state, "x", k)
                write(state, "view", k)
                if not torch.equal(state["views"]["head"], expected["base"][:64] + k):
                    msg = "a write through a view did not reach the base"
            os.write(write_fd, msg.encode()[:4000])
            code = 0 if not msg else 1
        except BaseException as exc:  # noqa: BLE001  (reported to the parent, never raised here)
            try:
                os.write(write_fd, repr(exc).encode()[:4000])
            except OSError:
                pass
        finally:
            os._exit(code)
    os.close(write_fd)
    deadline = time.monotonic() + CHILD_EXIT_S
    status: int | None = None
    while status is None:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(raw)
        elif time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            status = -9
        else:
            time.sleep(0.002)
    with os.fdopen(read, "rb") as f:
        said = f.read().decode(errors="replace")
    return status, said
