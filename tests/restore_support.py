"""Restore test support: a backend whose chunk reads can be held back, slowed and logged,
and a loader that loads only what the program waits for.

:class:`HeldBackend` gates only ``readinto_range`` (chunk reads); manifests and pack indexes
read normally, so ``restore()`` can plan while loading is held. :func:`on_demand` holds the
loader itself: a lazy restore then loads a span only once the program waits for it, so a
test sees the program run ahead of the loader however the threads are scheduled (no sleeps,
no slowed reads). A held read or reader waits at most ``HOLD_LIMIT`` seconds: that ends
only a hang (a broken test then fails instead of blocking the suite), never a slow machine.
"""

from __future__ import annotations

import random
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from faults import FaultyBackend

from gpusnap.config import Config
from gpusnap.storage.backend import LocalBackend
from gpusnap.storage.repository import Repository

__all__ = ["HOLD_LIMIT", "HeldBackend", "OnDemand", "blank_like", "held_root", "loader_batches", "mixed_state",
           "on_demand", "raw", "release_after", "states_equal", "tiny_config"]

HOLD_LIMIT = 240.0  # (under pytest's 300 s per test: a hang fails here, naming the hold)


class HeldBackend(FaultyBackend):
    """Chunk reads wait while held, then sleep ``delay`` (+ random ``jitter``), and are logged
    in ``chunk_reads`` as ``(path, offset)`` (``reads``, FaultyBackend's, names every read)."""

    def __init__(self, inner: LocalBackend, *, delay: float = 0.0, jitter: float = 0.0, seed: int = 0) -> None:
        super().__init__(inner)
        self.delay = delay
        self.jitter = jitter
        self.chunk_reads: list[tuple[str, int]] = []
        self._open = threading.Event()
        self._open.set()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def readinto_range(self, path: str, offset: int, out: memoryview) -> int:
        if not self._open.wait(HOLD_LIMIT):
            raise TimeoutError("HeldBackend: reads held for too long (the test never released them)")
        with self._lock:
            pause = self.delay + self._rng.random() * self.jitter
        if pause:
            time.sleep(pause)
        with self._lock:
            self.chunk_reads.append((path, offset))
        return super().readinto_range(path, offset, out)


@contextmanager
def held_root(root: Path, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> Iterator[HeldBackend]:
    """Every Checkpointer opened on ``root`` meanwhile reads chunks through one HeldBackend."""
    root.mkdir(parents=True, exist_ok=True)
    backend = HeldBackend(LocalBackend(root), **kwargs)
    real_open = Repository.open.__func__  # type: ignore[attr-defined]

    def open_held(cls: type[Repository], where: Any, **kw: Any) -> Repository:
        if Path(str(where)) == root:
            kw["backend"] = backend
        return real_open(cls, where, **kw)

    monkeypatch.setattr(Repository, "open", classmethod(open_held))
    try:
        yield backend
    finally:
        backend.release()


class OnDemand:
    """What :func:`on_demand` saw: the spans the program waited for (``Schedule.wait``, in
    order; only those not loaded yet), and the loads it let run whole."""

    def __init__(self) -> None:
        self.waited: list[int] = []
        self.opened = 0  # loads let run whole (a wait for everything)
        self._open: weakref.WeakSet[Any] = weakref.WeakSet()  # the schedules let run whole
        self._made: weakref.WeakSet[Any] = weakref.WeakSet()  # every schedule made meanwhile
        self._lock = threading.Lock()

    def is_open(self, schedule: Any) -> bool:
        return schedule in self._open

    def open(self, schedule: Any) -> None:
        with self._lock:
            if schedule not in self._open:
                self._open.add(schedule)
                self.opened += 1

    def open_all(self) -> None:
        """Every load begun so far runs to the end (a handle's wait: it does not say which)."""
        for schedule in list(self._made):
            self.open(schedule)


def on_demand(monkeypatch: pytest.MonkeyPatch) -> OnDemand:
    """From now on every restore's readers take a piece only when the program waits for its
    span (``Schedule.wait``: an op in the lazy gate, or ``restore()`` for what ``finish()``
    reads), or once something waits for the whole load (``Schedule.wait_all``: an opaque
    launch; ``Loader.join``: an eager restore, a later restore or save; ``RestoreHandle.wait``:
    every load begun so far); then that load runs to the end.

    Readers wait before they take a piece, never while holding one, so a span waited for is
    always taken by the next free reader: no deadlock, and no span loads unless asked.
    """
    from gpusnap.handles import RestoreHandle
    from gpusnap.restore.pipeline.loader import Loader
    from gpusnap.restore.pipeline.schedule import Schedule, SpanState

    demand = OnDemand()
    init, take_batch, wait, wait_all = Schedule.__init__, Schedule.take_batch, Schedule.wait, Schedule.wait_all
    join, handle_wait = Loader.join, RestoreHandle.wait

    def made(self: Schedule, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        demand._made.add(self)

    def asked(schedule: Schedule) -> bool:
        return (
            demand.is_open(schedule)
            or schedule.error is not None
            or any(ls.next_chunk < ls.chunks for ls in schedule._urgent)
            or all(ls.next_chunk >= ls.chunks for ls in schedule.spans)  # nothing left: take_batch ends
        )

    def held_take_batch(self: Schedule, *args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + HOLD_LIMIT  # (a hang guard only)
        with self.cond:
            # (Schedule.wait marks a span urgent without a notify: poll the condition)
            while not asked(self) and time.monotonic() < deadline:
                self.cond.wait(0.005)
        return take_batch(self, *args, **kwargs)

    def noted_wait(self: Schedule, ls: Any, *args: Any, **kwargs: Any) -> Any:
        if ls.state is not SpanState.LOADED:
            with demand._lock:
                demand.waited.append(ls.index)
        return wait(self, ls, *args, **kwargs)

    def opening_wait_all(self: Schedule, *args: Any, **kwargs: Any) -> Any:
        demand.open(self)
        return wait_all(self, *args, **kwargs)

    def opening_join(self: Loader, timeout: float | None = None) -> bool:
        if timeout is None or timeout > 0:
            demand.open(self.schedule)
        return join(self, timeout)

    def opening_handle_wait(self: RestoreHandle, timeout: float | None = None, *args: Any, **kwargs: Any) -> Any:
        if timeout is None or timeout > 0:
            demand.open_all()
        return handle_wait(self, timeout, *args, **kwargs)

    monkeypatch.setattr(Schedule, "__init__", made)
    monkeypatch.setattr(Schedule, "take_batch", held_take_batch)
    monkeypatch.setattr(Schedule, "wait", noted_wait)
    monkeypatch.setattr(Schedule, "wait_all", opening_wait_all)
    monkeypatch.setattr(Loader, "join", opening_join)
    monkeypatch.setattr(RestoreHandle, "wait", opening_handle_wait)
    return demand


def release_after(backend: HeldBackend, seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, backend.release)
    timer.daemon = True
    timer.start()
    return timer


def tiny_config(**overrides: Any) -> Config:
    """512-byte chunks: every tensor spans many chunks, so loading takes many steps."""
    values: dict[str, Any] = {"chunk_size": 512, "pack_size": 1 << 16, "io_threads": 2, "staging_bytes": 16 * 512}
    values.update(overrides)
    return Config(**values)


def raw(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s bytes taken below every dispatch mode: what memory holds right now."""
    from torch.utils._mode_utils import no_dispatch

    with no_dispatch():
        return t.detach().clone()


def corrupt_chunk(root: Path, needle: bytes, at: int) -> None:
    """Flip one bit ``at`` bytes into the first stored chunk that holds ``needle``."""
    for pack in (root / "packs").rglob("*.pack"):
        data = bytearray(pack.read_bytes())
        where = data.find(needle)
        if where >= 0:
            data[where + at] ^= 0x10
            pack.write_bytes(bytes(data))
            return
    raise AssertionError("chunk not found in any pack")


def add_device_hashes(root: Path, checkpoint_id: str) -> None:
    """Rewrite the manifest with each chunk's device hash, as a capture on a GPU writes it."""
    import dataclasses

    from gpusnap.kernels.chunk_hash import chunk_hashes, hashes_to_hex
    from gpusnap.storage.repository import Repository

    repo = Repository.open(root)
    manifest = repo.load_manifest(checkpoint_id)
    entries = []
    for e in manifest.storages:
        data = bytearray(b"".join(repo.read_chunk(d) for d in e.chunks))
        t = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        entries.append(dataclasses.replace(e, hashes=tuple(hashes_to_hex(chunk_hashes(t, manifest.chunk_size)))))
    new = dataclasses.replace(manifest, storages=tuple(entries))
    (root / "manifests" / f"{manifest.id}.json").write_bytes(new.to_json())


def mixed_state(device: torch.device | str = "cpu") -> dict[str, Any]:
    """Large spans (several pieces each with small pieces), 30 small ones (batched), a
    transposed tensor (not streamable: read whole) and a plain value."""
    torch.manual_seed(1)
    state: dict[str, Any] = {f"big{i}": torch.randn(3000 + 17 * i, device=device) for i in range(6)}
    state.update({f"s{i}": torch.randn(7 + i, device=device) for i in range(30)})
    state["t"] = torch.randn(40, 30, device=device).t()
    state["step"] = 7
    return state


def blank_like(state: dict[str, Any]) -> dict[str, Any]:
    """Zeros of the same shapes (and 0 for plain values): a restore target."""
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}


def states_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def log_ranges(monkeypatch: pytest.MonkeyPatch, log: Any) -> None:
    """Call ``log(span index)`` on every ``apply_range`` of a restore (the copy thread's and
    the readers' own, for host targets), before it copies."""
    from gpusnap.restore import apply_bytes
    from gpusnap.restore.pipeline import copier, loader

    real = apply_bytes.apply_range

    def apply_range(plan: Any, index: int, offset: int, data: Any, **kw: Any) -> None:
        log(index)
        real(plan, index, offset, data, **kw)

    for module in (copier, loader):
        monkeypatch.setattr(module, "apply_range", apply_range)


def loader_batches(monkeypatch: pytest.MonkeyPatch, keep: Any) -> list[int]:
    """The reader threads of the batches the loader takes whose first span passes ``keep``
    (a ``LoadSpan`` predicate), in the order taken."""
    from gpusnap.restore.pipeline.loader import Loader

    seen: list[int] = []
    real = Loader._read

    def read(self: Loader, batch: list[Any], k: int = 0) -> None:
        if keep(batch[0][0].span):
            seen.append(k)
        real(self, batch, k)

    # private: no public seam counts the batches by kind (handle.stats has only totals per source)
    monkeypatch.setattr(Loader, "_read", read)
    return seen
