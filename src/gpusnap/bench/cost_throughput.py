"""Throughput with a save every N steps, against plain steps, on the wall clock and the CPU.

A run of ``steps`` steps (loss read each step, see :mod:`.cost`) saves at the first of every
``n`` steps, so the last save has ``n - 1`` steps to drain behind as in a long run, then waits
until every save is durable. Each system keeps its own policy for a save that finds the
previous one still running (gpusnap's queue, one write in flight for the baselines): that is
what a user of it pays. steps/s = ``steps`` / wall; loss = 1 - (steps/s with saves) /
(steps/s of the plain window). A run past ``deadline`` stops at the next multiple of ``n``
(at least one save), so the figure always covers whole periods.

Where a run is not measured, :func:`derived` estimates it from one warm save's cost:
``cost / (n x step + cost)``, exact when a save is durable within ``n`` steps (saves then
never overlap), and left out otherwise.
"""

from __future__ import annotations

from typing import Any

from gpusnap.bench.cost import Clocks, Window, read_step
from gpusnap.bench.system import SaveHandle, System, sync
from gpusnap.bench.workloads import Workload

__all__ = ["derived", "every_n"]


def every_n(
    wl: Workload, system: System, n: int, steps: int, plain: Window, *, clocks: Clocks, deadline: float, first: int = 1000
) -> dict[str, Any]:
    handles: list[SaveHandle] = []
    prepare_wall = prepare_cpu = 0.0
    sync(wl.device)
    w0, c0 = clocks.wall(), clocks.cpu()
    done, cut = 0, False
    while done < steps:
        hook = None
        if done % n == 0:
            if handles and clocks.wall() > deadline:
                cut = True
                break
            p0, q0 = clocks.wall(), clocks.cpu()
            system.prepare_save(wl, first + len(handles))  # rotation a user's keep_last does: not charged
            prepare_wall, prepare_cpu = prepare_wall + clocks.wall() - p0, prepare_cpu + clocks.cpu() - q0
            handle = system.save(wl, first + len(handles))
            handles.append(handle)
            hook = handle.before_mutation
        read_step(wl, hook)
        done += 1
    for handle in handles:
        handle.wait()
    sync(wl.device)
    wall = clocks.wall() - w0 - prepare_wall
    cpu = clocks.cpu() - c0 - prepare_cpu
    plain_sps = 1.0 / plain.step_wall_s
    sps = done / wall
    return {
        "every": n, "steps": done, "saves": len(handles), "wall_s": wall, "cpu_s": cpu,
        "steps_per_s": sps, "plain_steps_per_s": plain_sps, "loss": 1.0 - sps / plain_sps,
        "cpu_per_save_s": (cpu - done * plain.step_cpu_s) / len(handles),
        "how": "measured", "cut_by_time": cut,
    }


def derived(n: int, cost_s: float | None, durable_s: float | None, plain: Window) -> dict[str, Any] | None:
    """The loss at a save every ``n`` steps from one save's cost; None where saves would overlap.

    >>> derived(10, 1.0, 0.5, Window(10, 1.0, 0.5))["loss"]
    0.5
    """
    period = n * plain.step_wall_s
    if cost_s is None or durable_s is None or durable_s > period:
        return None
    return {"every": n, "loss": cost_s / (period + cost_s), "how": "derived: warm cost / (N x plain step + warm cost)"}
