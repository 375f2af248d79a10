"""Fast-tier test support: small configs, deterministic training state, bit-exact comparison,
and a gate that holds promotions inside the durable store until the test releases them.

Every test of the fast tier (``tests/test_fast_tier_*.py``) runs on CPU: the slabs are files
under pytest's ``tmp_path`` (host memory or not, the code paths are the same), the device
hashes are the torch fallback of ``kernels/chunk_hash.py``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from faults import HANG_S
from torch import nn

import gpusnap
from gpusnap import Config
from gpusnap.storage.fast_tier import FastTier, chunk_location
from gpusnap.storage.promote import check_runs, gather_small
from gpusnap.storage.repository import Repository
from gpusnap.storage.txn import WriteTxn

__all__ = [
    "CFG",
    "memory_tier_of",
    "run_killed",
    "HANG_S",
    "DurableGate",
    "blank_state",
    "cfg",
    "durable_backend",
    "hold_durable_writes",
    "in_thread",
    "locations",
    "make_state",
    "overlapping",
    "roots",
    "run_on_small_tmpfs",
    "same",
    "snapshot",
    "train",
]

# 64 KiB chunks, 256 KiB copy pieces, 2 MiB slabs: a state of ~1 MB spans a few of each
CFG = Config(chunk_size=64 * 1024, copy_piece_bytes=256 * 1024, fast_slab_bytes=2 << 20)


def cfg(**overrides: Any) -> Config:
    """:data:`CFG` with ``overrides``."""
    return dataclasses.replace(CFG, **overrides)


def make_state(seed: int, *, width: int = 64, extra: int = 100_000) -> dict[str, Any]:
    """A model, its AdamW optimizer (one step taken: it has state), a plain tensor and plain
    values, all a function of ``seed``."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2 * width))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": optim, "x": torch.randn(extra), "step": seed, "name": f"run-{seed}",
             "blob": bytes(range(seed % 7, seed % 7 + 40)), "lr": 0.5 / (seed + 1)}
    train(state, seed)
    return state


def train(state: dict[str, Any], seed: int) -> None:
    """One deterministic optimizer step, and new plain values: everything changes."""
    model, optim = state["model"], state["optim"]
    gen = torch.Generator().manual_seed(10_000 + seed)
    width = model[0].in_features
    model(torch.randn(8, width, generator=gen)).square().sum().backward()
    optim.step()
    optim.zero_grad()
    state["x"].add_(torch.randn(state["x"].shape, generator=gen))
    state["step"] = seed
    state["name"] = f"run-{seed}"


def blank_state(like: dict[str, Any]) -> dict[str, Any]:
    """A state of the same structure as ``like`` whose every value differs (a fresh process's)."""
    torch.manual_seed(999_999)
    width = like["model"][0].in_features
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2 * width))
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-3),
            "x": torch.full_like(like["x"], 7.0), "step": -1, "name": "", "blob": b"", "lr": -1.0}


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """Every value of ``state`` by key path, tensors cloned (what a save at this moment holds)."""
    out: dict[str, Any] = {}

    def walk(path: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            out[path] = value.detach().clone()
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{path}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{path}/{i}", v)
        else:
            out[path] = value

    for key, value in state.items():
        walk(key, value.state_dict() if isinstance(value, (nn.Module, torch.optim.Optimizer)) else value)
    return out


def same(got: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """Key paths whose values differ, bit for bit (empty: identical)."""
    wrong = sorted(set(got) ^ set(expected))
    for path in sorted(set(got) & set(expected)):
        a, b = got[path], expected[path]
        if isinstance(b, torch.Tensor):
            ok = (isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                  and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
        else:
            ok = type(a) is type(b) and a == b
        if not ok:
            wrong.append(path)
    return wrong


def locations(manifest: Any) -> list[tuple[int, int, int]]:
    """``(slab, offset, length)`` of every chunk a fast manifest names."""
    return [chunk_location(name)[1:] for s in manifest.storages for name in s.chunks]


def overlapping(manifest: Any, others: list[Any]) -> list[str]:
    """Chunks of ``manifest`` whose slab bytes a chunk of ``others`` also covers (reused)."""
    used = [(s, o, o + n) for m in others for s, o, n in locations(m)]
    out = []
    for name in (n for st in manifest.storages for n in st.chunks):
        _h, slab, off, n = chunk_location(name)
        if any(s == slab and lo < off + n and off < hi for s, lo, hi in used):
            out.append(name)
    return out


class DurableGate:
    """Holds every chunk a durable write transaction stores (a promotion, with a fast root)
    until :meth:`release`; :attr:`entered` is set when the first one arrives."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.held = 0

    def release(self) -> None:
        self.opened.set()

    def wait_entered(self) -> None:
        assert self.entered.wait(HANG_S), "no durable write started (was a promotion due?)"


def hold_durable_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[DurableGate]:
    """A :class:`DurableGate` on ``WriteTxn.put_run`` (a promotion's writes; ``put_chunk``
    goes through it too), released at the end whatever happens (a test module's fixture
    yields from it)."""
    g = DurableGate()
    put_run = WriteTxn.put_run

    def gated(self: Any, digests: list[str], data: Any, lengths: list[int]) -> int:
        g.held += 1
        g.entered.set()
        if not g.opened.wait(HANG_S):
            raise TimeoutError("the durable gate was never released")
        return put_run(self, digests, data, lengths)

    monkeypatch.setattr(WriteTxn, "put_run", gated)
    yield g
    g.release()


def durable_backend(monkeypatch: pytest.MonkeyPatch, durable: Path, backend: Any) -> Any:
    """Every Repository opened at ``durable`` (the Checkpointer's durable root) goes through
    ``backend`` (a ``faults.FaultyBackend`` over the real one): faults injected at the
    storage backend, through Repository.open's ``backend`` argument."""
    backend.local_path = backend.inner.local_path
    real_open = Repository.open.__func__  # type: ignore[attr-defined]

    def open_(cls: Any, root: Any, **kw: Any) -> Any:
        if os.fspath(root) == os.fspath(durable):
            kw["backend"] = backend
        return real_open(cls, root, **kw)

    monkeypatch.setattr(Repository, "open", classmethod(open_))
    return backend


def run_on_small_tmpfs(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (its first argument: an empty directory it may mount a tmpfs on) in a
    mount namespace of its own; skips where the machine allows none or refuses the mount."""
    prefix = None
    if shutil.which("unshare") is not None:
        probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, check=False)
        prefix = ["unshare", "-rm"] if probe.returncode == 0 else None
    if prefix is None:
        pytest.skip("no private mount namespace here (unshare -rm) to mount a small tmpfs in")
    mount = tmp_path / "mnt"
    mount.mkdir()
    path = tmp_path / "on_tmpfs.py"
    path.write_text(script)
    run = subprocess.run([*prefix, sys.executable, str(path), str(mount), *args],
                         capture_output=True, text=True, timeout=300, check=False)
    if run.returncode != 0 and "mount" in run.stderr and "CalledProcessError" in run.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {run.stderr.strip().splitlines()[-1]}")
    return run


def roots(tmp_path: Path) -> tuple[Path, Path]:
    """A durable root and a fast root under ``tmp_path`` (neither exists yet)."""
    return tmp_path / "durable", tmp_path / "fast"


def run_killed(tmp_path: Path, script: str, root: Path) -> str:
    """Run ``script`` (arguments: ``root``, this directory) in a child process that kills
    itself with SIGKILL; returns the first word it printed (a checkpoint id)."""
    path = tmp_path / "killed.py"
    path.write_text(script)
    run = subprocess.run([sys.executable, str(path), str(root), str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == -9, run.stderr
    return run.stdout.split()[0]


def memory_tier_of(root: Path) -> Path:
    """Where the default path's memory tier of ``root`` lives in this test session."""
    from gpusnap.save.memory_tier import memory_tier_path

    return Path(memory_tier_path(os.environ["GPUSNAP_MEMORY_TIER_DIR"], os.path.realpath(root)))


def in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn`` on a daemon thread; returns the thread and a dict that gets ``value`` (what
    it returned) or ``error`` (what it raised)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 (the test looks at it)
            out["error"] = exc

    t = threading.Thread(target=run, name=f"test-{getattr(fn, '__name__', 'fn')}", daemon=True)
    t.start()
    return t, out


def saved_for_promotion(tmp_path: Path) -> tuple[Path, Path, FastTier, Any, list[list[str]]]:
    """A fast-tier checkpoint of several storages: (durable, fast, its tier, its manifest, the
    runs a promotion's pool writes: those of the chunks it does not gather)."""
    durable, fast = roots(tmp_path)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        info = ck.save(make_state(3, width=256)).wait()  # (its weights and moments: whole chunks)
    tier = FastTier.open(fast)
    manifest = tier.load_manifest(info.id)
    runs = check_runs(gather_small([n for e in manifest.storages for n in e.chunks], CFG.chunk_size)[1], CFG.chunk_size)
    assert len(runs) >= 4
    return durable, fast, tier, manifest, runs
