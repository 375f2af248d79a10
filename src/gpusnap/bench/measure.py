"""Step timing and the per-checkpoint figures.

Every step is timed between two synchronisations of the program's current CUDA stream, so a
step's time is the wall time the program needed for it, its CUDA work included, but not the
work of a checkpointer's own streams (a device-wide synchronize would make the program wait
for copies it never waits for in real life). Definitions (docs/bench.md has the long form):

- *median step*: median of un-checkpointed steps measured before any save of the workload.
- *stall of a save*: the sum, over the step that contains the save and every later step
  until the save is durable, of (step time - median step). Blocking saves stall only the
  step that contains them. ``stall_first_step_s`` is the same for the containing step alone.
- *captured* / *durable*: seconds from the save call to those moments (see ``SaveHandle``).
- *extra device memory*: peak allocated during the save window minus the peak of a plain step.
- *throughput loss* at every N: wall time of ``S`` steps with a save at the first of every N
  steps (waiting at the end until the last save is durable) over ``S`` x median step, minus
  one. A save at the last step would charge its whole write to the run (8-10% at N=100 on
  GPT-2 large, where a long run hides it behind the next 99 steps).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from gpusnap.bench.summary import jsonable
from gpusnap.bench.system import SaveHandle, System, sync
from gpusnap.bench.workloads import Hook, Workload

__all__ = [
    "PlainSteps",
    "SaveSample",
    "d2h_bandwidth",
    "every_n",
    "measure_save",
    "plain_steps",
    "stream_sync",
    "timed_step",
]


def stream_sync(device: torch.device) -> None:
    """Wait for the program's own stream only (checkpointers' streams run on)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def timed_step(wl: Workload, hook: Hook | None = None) -> float:
    stream_sync(wl.device)
    t0 = time.perf_counter()
    wl.step(hook)
    stream_sync(wl.device)
    return time.perf_counter() - t0


def _peak_reset(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak_since(device: torch.device, base: int) -> int:
    return torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0


@dataclass
class PlainSteps:
    median_s: float
    samples: list[float]
    peak_extra_bytes: int  # device bytes a plain step allocates above the resting state


def plain_steps(wl: Workload, n: int, *, warmup: int) -> PlainSteps:
    for _ in range(warmup):
        timed_step(wl)
    base = _peak_reset(wl.device)
    samples = [timed_step(wl) for _ in range(max(1, n))]
    return PlainSteps(statistics.median(samples), samples, _peak_since(wl.device, base))


@dataclass
class SaveSample:
    """One measured save (seconds, bytes)."""

    stall_s: float
    stall_first_step_s: float
    call_s: float
    captured_s: float | None
    durable_s: float | None
    steps_in_window: int
    extra_device_bytes: int
    stats: dict[str, Any] = field(default_factory=dict)
    durable_note: str | None = None
    timeline: list[dict[str, Any]] | None = None

    def as_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        if out["timeline"] is None:
            del out["timeline"]
        return out


def measure_save(
    wl: Workload,
    system: System,
    index: int,
    plain: PlainSteps,
    *,
    max_window_steps: int,
    max_window_s: float,
    record_timeline: bool = False,
) -> SaveSample:
    """Runs the step containing save ``index``, then plain steps until it is durable."""
    events: list[dict[str, Any]] | None = [] if record_timeline else None
    base = _peak_reset(wl.device)
    sync(wl.device)  # a clean start: nothing of earlier saves still running anywhere
    t0 = time.perf_counter()
    handle = system.save(wl, index)
    call_end = time.perf_counter()
    handle.mark()
    step_start = time.perf_counter()
    wl.step(handle.before_mutation)
    stream_sync(wl.device)
    t1 = time.perf_counter()
    if events is not None:
        events += [_event("save() call", t0, call_end, t0), _event("step 0 (contains the save)", step_start, t1, t0)]
    first = (t1 - t0) - plain.median_s
    stall, n = first, 0
    while not _settled(handle) and n < max_window_steps and time.perf_counter() - t0 < max_window_s:
        s0 = time.perf_counter()
        dt = timed_step(wl)
        stall += dt - plain.median_s
        n += 1
        if events is not None and n <= _MAX_EVENTS:
            events.append(_event(f"step {n}", s0, s0 + dt, t0))
    stats = handle.wait()
    sync(wl.device)
    handle.mark()
    extra = max(0, _peak_since(wl.device, base) - plain.peak_extra_bytes)
    if events is not None:
        for name, at in (("captured", handle.captured_at), ("durable", handle.durable_at)):
            if at is not None:
                events.append({"name": name, "kind": "instant", "t": at - t0})
    return SaveSample(
        stall_s=stall,
        stall_first_step_s=first,
        call_s=call_end - t0,
        captured_s=None if handle.captured_at is None else handle.captured_at - t0,
        durable_s=None if handle.durable_at is None else handle.durable_at - t0,
        steps_in_window=n,
        extra_device_bytes=extra,
        stats=jsonable(stats),
        durable_note=handle.durable_note,
        timeline=events,
    )


_MAX_EVENTS = 2000  # step spans kept for a timeline (a decode window can hold thousands)


def _settled(handle: SaveHandle) -> bool:
    """A save stops costing steps once durable (or captured, for saves never durable)."""
    handle.mark()
    if handle.durable_note is not None:
        return handle.captured_at is not None
    return handle.durable_at is not None


def _event(name: str, start: float, end: float, t0: float) -> dict[str, Any]:
    return {"name": name, "kind": "span", "start": start - t0, "end": end - t0}


def every_n(wl: Workload, system: System, n: int, steps: int, median_s: float) -> dict[str, Any]:
    """Throughput loss with a save every ``n`` steps over ``steps`` steps (drained at the end)."""
    prepare_s = 0.0
    handles: list[SaveHandle] = []
    sync(wl.device)  # a clean start
    t0 = time.perf_counter()
    for i in range(steps):
        hook = None
        if i % n == 0:  # first step of each N: the last save has N - 1 steps to drain, as in a long run
            p0 = time.perf_counter()
            system.prepare_save(wl, 1000 + len(handles))
            prepare_s += time.perf_counter() - p0
            handle = system.save(wl, 1000 + len(handles))
            handles.append(handle)
            hook = handle.before_mutation
        wl.step(hook)
    for handle in handles:
        handle.wait()
    stream_sync(wl.device)
    total = time.perf_counter() - t0 - prepare_s
    return {"every": n, "steps": steps, "saves": len(handles), "wall_s": total, "loss": total / (steps * median_s) - 1.0,
            "how": "measured"}


def d2h_bandwidth(device: torch.device, nbytes: int) -> dict[str, Any]:
    """Best of five device-to-pinned-host copies of ``nbytes``: the capture bandwidth ceiling."""
    if device.type != "cuda":
        return {"bytes": 0, "GBps": None, "note": "no CUDA: no device-to-host copy to measure"}
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return {"bytes": nbytes, "GBps": nbytes / best / 1e9, "seconds": best}
