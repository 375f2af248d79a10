"""What one checkpoint costs the training job that takes it, on the wall clock and the CPU.

A *window* is a run of training steps timed on two clocks: wall time (``time.perf_counter``)
and this process's CPU time (``time.process_time``: user plus system seconds of every thread
of the process, so checkpointers' background threads count; child processes would not, and
no row here uses any). Every step reads its loss (``loss.item()``) as a real loop does, so a
step ends when its GPU work is done and no other synchronization is added.

- *plain window*: ``n`` steps, no save; the runner times one right before each save window
  and charges that save against it (the step time drifts a few ms over a run).
- *save window*: opens right before ``save()``, runs the step containing the save and at
  least ``n - 1`` more, and goes on a whole step at a time until the save is durable (what
  ``pending.wait()`` waits for: committed to its target, the fast tier for a fast-tier save):
  ``m >= n`` steps in all. The loop calls the system's ``wait()`` as soon as it sees the save
  durable (it returns at once), as a loop that polls ``done()`` and then collects the info.
- *cost on training* = save window's wall - ``m`` x (plain wall / ``n``); *host CPU-seconds*
  = save window's CPU - ``m`` x (plain CPU / ``n``). With ``m == n``: "``n`` steps holding
  one save minus ``n`` plain steps", on each clock.
- *bracketed*: the runner charges each save against the plain windows on both sides of it
  (:func:`bracket`: their mean step), so that a step time drifting over the run cancels;
  ``drift_s`` = ``m`` x (the plain step after - the one before) says how much the one-sided
  figure (``cost_before_only_s``) could be off by. A single save's one-sided
  figure moved by up to ±100 ms this way (BENCHMARKS.md).
- *durable bandwidth* = checkpointed bytes / (``save()`` to durable).
- *stall after save()*: wall from ``save()`` to the end of the step containing it, minus one
  plain step (the pause the program sees at once; not the headline: later steps pay too).

Clocks are injected (:class:`Clocks`) so tests can drive both with a virtual clock.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpusnap.bench.summary import jsonable
from gpusnap.bench.system import SaveHandle, System, sync
from gpusnap.bench.workloads import Hook, Workload

__all__ = ["Clocks", "CostSample", "Window", "bracket", "cost_window", "plain_window", "pooled", "read_step"]


@dataclass(frozen=True)
class Clocks:
    wall: Callable[[], float] = time.perf_counter
    cpu: Callable[[], float] = time.process_time


@dataclass(frozen=True)
class Window:
    """``steps`` steps took ``wall_s`` seconds and ``cpu_s`` CPU-seconds of the process."""

    steps: int
    wall_s: float
    cpu_s: float

    @property
    def step_wall_s(self) -> float:
        return self.wall_s / self.steps

    @property
    def step_cpu_s(self) -> float:
        return self.cpu_s / self.steps


def read_step(wl: Workload, hook: Hook | None = None) -> None:
    """One step, then its loss read on the host (``loss.item()``), as a training loop does."""
    out = wl.step(hook)
    if out is not None:
        out.reshape(-1)[0].item()


def plain_window(wl: Workload, n: int, clocks: Clocks) -> Window:
    sync(wl.device)  # nothing of earlier work still running when the clocks start
    w0, c0 = clocks.wall(), clocks.cpu()
    for _ in range(n):
        read_step(wl)
    return Window(n, clocks.wall() - w0, clocks.cpu() - c0)


@dataclass
class CostSample:
    """One save's window, and what it cost against a plain window (seconds, bytes)."""

    index: int
    steps: int  # m: steps in the window
    wall_s: float
    cpu_s: float
    cost_s: float
    cpu_cost_s: float
    call_s: float
    stall_s: float
    durable_s: float | None
    durable_GBps: float | None
    nbytes: int
    step_s: list[float] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    note: str | None = None  # e.g. the window ran out before the save was durable
    # set by bracket(): the cost against the plain window before alone, and how far the plain
    # step moved between the windows on both sides (x steps)
    cost_before_only_s: float | None = None
    drift_s: float | None = None

    def as_json(self) -> dict[str, Any]:
        return jsonable(dict(self.__dict__))  # type: ignore[no-any-return]


def pooled(first: Window, second: Window) -> Window:
    """Two plain windows as one: their mean step over both."""
    return Window(first.steps + second.steps, first.wall_s + second.wall_s, first.cpu_s + second.cpu_s)


def bracket(sample: CostSample, before: Window, after: Window) -> CostSample:
    """``sample`` charged against the mean step of the plain windows before and after it."""
    both = pooled(before, after)
    window = Window(sample.steps, sample.wall_s, sample.cpu_s)
    cost, cpu_cost = charge(window, both)
    first_step = sample.stall_s + before.step_wall_s  # (stall_s was charged one plain step before)
    return dataclasses.replace(
        sample, cost_s=cost, cpu_cost_s=cpu_cost, stall_s=first_step - both.step_wall_s,
        cost_before_only_s=sample.cost_s, drift_s=sample.steps * (after.step_wall_s - before.step_wall_s))


def charge(window: Window, plain: Window) -> tuple[float, float]:
    """(cost, CPU cost) of ``window`` over as many plain steps as it ran."""
    return window.wall_s - window.steps * plain.step_wall_s, window.cpu_s - window.steps * plain.step_cpu_s


def cost_window(
    wl: Workload,
    system: System,
    index: int,
    n: int,
    plain: Window,
    *,
    nbytes: int,
    clocks: Clocks,
    max_steps: int = 100_000,
    max_s: float = 600.0,
    save: Callable[[], SaveHandle] | None = None,
) -> CostSample:
    """Save ``index`` of ``system`` in a window of at least ``n`` steps, until it is durable.

    ``save`` replaces ``system.save(wl, index)`` (the fast tier's promoted save)."""
    sync(wl.device)  # a clean start: earlier saves' work and the program's own all done
    w0, c0 = clocks.wall(), clocks.cpu()
    handle = save() if save is not None else system.save(wl, index)
    call_end = clocks.wall()
    ends: list[float] = []
    seen: float | None = None  # when the loop first saw the save durable
    stats: dict[str, Any] | None = None
    while True:
        read_step(wl, handle.before_mutation if not ends else None)
        now = clocks.wall()
        ends.append(now)
        if seen is None and handle.is_durable():
            seen = now
            stats = handle.wait()
        if len(ends) >= n and seen is not None:
            break
        if len(ends) >= max_steps or now - w0 > max_s:
            break
    w1, c1 = clocks.wall(), clocks.cpu()
    note = None
    if stats is None:
        note = f"not durable within the window ({len(ends)} steps, {w1 - w0:.1f} s): waited after it, uncounted"
        stats = handle.wait()
    window = Window(len(ends), w1 - w0, c1 - c0)
    cost, cpu_cost = charge(window, plain)
    # the system's own moment where it reports one (same clock as its started), else the step
    durable_s = handle.durable_at - handle.started if handle.durable_at is not None else None
    if durable_s is None and seen is not None:
        durable_s = seen - w0
    starts = [w0, *ends[:-1]]
    return CostSample(
        index=index,
        steps=window.steps,
        wall_s=window.wall_s,
        cpu_s=window.cpu_s,
        cost_s=cost,
        cpu_cost_s=cpu_cost,
        call_s=call_end - w0,
        stall_s=(ends[0] - w0) - plain.step_wall_s,
        durable_s=durable_s,
        durable_GBps=nbytes / durable_s / 1e9 if durable_s else None,
        nbytes=nbytes,
        step_s=[e - s for s, e in zip(starts, ends)],
        stats=dict(stats),
        note=note,
    )
