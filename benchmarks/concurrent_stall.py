"""Stall per checkpoint of a GPT-2 training loop: gpusnap concurrent vs blocking vs baselines.

Run on a GPU machine from the repository root:
    PYTHONPATH=src python3 benchmarks/concurrent_stall.py --model gpt2-large --saves 4 --every 5

One process measures, side by side: the median training step at rest (before any checkpointer
exists, and again after every window has closed), a stop-the-world copy into preallocated
pinned memory, `torch.save` to tmpfs, gpusnap's blocking save, and gpusnap's concurrent save
in two placements:
  * ``after``: save() right after optimizer.step() (the usual place);
  * ``cow``:   save() between backward() and optimizer.step(), so the step overwrites every
               buffer at once (the copy-on-write-heavy case).
Stall per save = (time of the step that contains save()) - (median step at rest), and the
whole interval's inflation (``--every`` steps from that one on) is reported too.

Each save's expected bytes are cloned, then the save is waited for (untimed: ``wait_s``
says how long, ``durable_in_interval`` whether it was durable by the interval's end),
restored into a second model and compared bit for bit, before the next save. So no save's
durable writes overlap the next save, and a loop that saves faster than it can write (with
``max_pending_saves`` pushing back) is not what this measures.
  * steps synchronized (default): the clone is taken before the step's clock starts;
  * ``--pipelined``: in stream order at the consistent point, its device time left out of
    the step, its host time (one ``torch.cat`` per device over views built once) not.
CPU runs (``--model tiny``) are smoke tests, not performance figures.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import gc
import io
import json
import os
import pstats
import shutil
import statistics
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

import gpusnap


def build(name: str, device: torch.device, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    sizes = {"gpt2": (12, 768, 12), "gpt2-large": (36, 1280, 20), "tiny": (2, 64, 2)}
    n_layer, n_embd, n_head = sizes[name]
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=1024)
    model = GPT2LMHeadModel(cfg).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optim


def state_tensors(model, optim) -> list[torch.Tensor]:
    out = list(model.state_dict().values())
    for s in optim.state.values():
        out += [v for v in s.values() if torch.is_tensor(v)]
    return out


def state_views(model, optim) -> list[list[torch.Tensor]]:
    """A uint8 view of each state tensor, grouped by device (devices in name order)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in state_tensors(model, optim):
        by_device.setdefault(t.device, []).append(t.detach().reshape(-1).view(torch.uint8))
    return [parts for _, parts in sorted(by_device.items(), key=lambda kv: str(kv[0]))]


def clone_state(model, optim) -> list[torch.Tensor]:
    """The state's bytes in one buffer per device (AdamW's step counts are on the CPU): a few
    objects for Python's collector to walk while the saves run, not one tensor per state
    tensor (a kept list of 1745 clones per save made the bench's own full collections costlier)."""
    return [torch.cat(parts) for parts in state_views(model, optim)]


class HostEvent:
    """``torch.cuda.Event``'s timing calls on the CPU, where every op is done when it returns:
    CPU runs take the pipelined path too (smoke tests; not performance figures)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: HostEvent) -> float:
        return (other.t - self.t) * 1e3


class EventSpan:
    """A step timed on the device (``--pipelined``): the seconds between two events on the
    program's stream, less the spans of the bench's own device work inside it (the clone of
    the expected bytes). Read with ``float()``, which waits for the end event only."""

    def __init__(self, start: Any, end: Any, excluded: list[tuple[Any, Any]]) -> None:
        self.start, self.end, self.excluded = start, end, excluded

    def __float__(self) -> float:
        self.end.synchronize()
        ms = self.start.elapsed_time(self.end) - sum(a.elapsed_time(b) for a, b in self.excluded)
        return ms / 1e3


def seconds(step: float | EventSpan) -> float:
    return float(step)


class Loop:
    """The training loop. By default each step is timed between two synchronizations, so a
    step's time includes every host cost inside it (save()'s own host time among them).
    ``pipelined``: no synchronization between steps, as in a loop that does not read the loss
    every step; the host runs ahead of the device (up to the launch queue), and a step is
    timed on the device (``EventSpan``): host time shows only where the device waits for it."""

    def __init__(self, model, optim, data, dev: torch.device, pipelined: bool = False) -> None:
        self.model, self.optim, self.data, self.dev = model, optim, data, dev
        self.pipelined = pipelined
        self.host_s = 0.0  # the last step's host time: until every op was enqueued (no sync)
        self.excluded: list[tuple[Any, Any]] = []
        self._expected: list[torch.Tensor] | None = None
        self._views: list[list[torch.Tensor]] | None = None

    def event(self) -> Any:
        return torch.cuda.Event(enable_timing=True) if self.dev.type == "cuda" else HostEvent()

    def expected_out(self) -> list[torch.Tensor]:
        """Buffers for the clone of the expected bytes, allocated at the first call and reused
        (the bench checks each save before the next one)."""
        if self._expected is None:
            self._expected = clone_state(self.model, self.optim)
        return self._expected

    def clone_expected(self) -> list[torch.Tensor]:
        """The state's bytes now, into ``expected_out()``: one ``torch.cat`` per device over
        byte views of the state built at the first call (walking the state_dicts each time
        cost ~5 ms of host time inside a pipelined step). The state's tensors must stay the
        same objects, as in this loop; if they did not, the check after the save fails."""
        if self._views is None:
            self._views = state_views(self.model, self.optim)
        return [torch.cat(views, out=buf) for views, buf in zip(self._views, self.expected_out())]

    def steps(self, n: int) -> list[float]:
        """``n`` plain steps, in seconds."""
        return [seconds(t) for t in [self.step() for _ in range(n)]]

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def exclude(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (the bench's own device work) inside the current step, its device time
        left out of the step's (pipelined) or its host and device time both (synchronized:
        done before the step's clock starts, see ``one_save``)."""
        if not self.pipelined:
            return fn()
        a, b = self.event(), self.event()
        a.record()
        out = fn()
        b.record()
        self.excluded.append((a, b))
        return out

    def step(self, hook: Callable[[], None] | None = None, where: str = "after") -> float | EventSpan:
        """One training step: seconds with the device drained on both ends, or (pipelined) an
        ``EventSpan`` read later."""
        if self.pipelined:
            start = self.event()
            start.record()
        else:
            self.sync()
        t0 = time.perf_counter()
        if hook is not None and where == "after":  # right after the previous optimizer.step()
            hook()
        loss = self.model(self.data, labels=self.data).loss
        loss.backward()
        if hook is not None and where == "cow":
            hook()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        self.host_s = time.perf_counter() - t0
        if self.pipelined:
            end = self.event()
            end.record()
            span, self.excluded = EventSpan(start, end, self.excluded), []
            return span
        self.sync()
        return time.perf_counter() - t0


def timed(loop: Loop, fn: Callable[[], Any]) -> float:
    loop.sync()
    t0 = time.perf_counter()
    fn()
    loop.sync()
    return time.perf_counter() - t0


def peak_extra(loop: Loop, fn: Callable[[], float]) -> tuple[float, int]:
    """Run ``fn``; its result and the peak device memory above what was allocated before."""
    if loop.dev.type != "cuda":
        return fn(), 0
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    return out, torch.cuda.max_memory_allocated() - base


def state_dict_costs(model, optim) -> dict[str, float]:
    """Host time of what save() cannot avoid (the state_dict() calls) against gpusnap's whole
    flatten, the plan reused: the part of flatten that is gpusnap's own."""
    from gpusnap.state.flatten import flatten

    app = {"model": model, "optim": optim, "step": 0}
    plan = flatten(app).plan

    def med(fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return {"model.state_dict": med(model.state_dict), "optim.state_dict": med(optim.state_dict),
            "flatten(plan)": med(lambda: flatten(app, plan=plan))}


class FullCollections:
    """Python's full (generation 2) garbage collections while it is active: count, seconds."""

    def __init__(self) -> None:
        self.count, self.seconds, self._start = 0, 0.0, None
        self.active = True  # off while the bench checks a save
        self.objects: list[int] = []  # objects left in the oldest generation after each

    def census(self) -> list[tuple[str, int]]:
        """The commonest types in the oldest generation now (what a full collection walks)."""
        counts = collections.Counter(type(o).__name__ for o in gc.get_objects(2))
        return counts.most_common(8)

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2 or not (self.active or self._start is not None):
            return
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.count += 1
            self.seconds += time.perf_counter() - self._start
            self._start = None
            self.objects.append(len(gc.get_objects(2)))  # (after the timing)

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


PROFILE_SAVE = False


def one_save(loop: Loop, ck: gpusnap.Checkpointer, app: dict, where: str, tag: str, every: int,
             plain_peak: int, profile: bool = False, full: FullCollections | None = None) -> dict[str, Any]:
    """One concurrent save placed at ``where``, then the rest of its interval (``every``
    steps in all), then (untimed) the wait until it is durable and its check against the
    expected bytes: the row of measurements ``finish_rows`` turns into stalls. Checking each
    save before the next keeps one clone of the state alive, not one per save (12 clones of
    GPT-2 large's 9.5 GB would not fit an H200 beside the model), and no save's durable
    writes overlap the next save."""
    box: dict[str, Any] = {}
    if loop.pipelined:
        for _ in range(2):  # let the host get ahead of the device, as in a loop that never syncs
            loop.step()
    else:
        # forward/backward change no state bytes (grads are not state), so a clone before the
        # timed step equals the state at either save point, and stays out of the timing
        box["expected"] = loop.clone_expected()

    def hook() -> None:
        if loop.pipelined:  # in stream order at the consistent point, its device time excluded
            box["expected"] = loop.exclude(loop.clone_expected)
        if profile:  # where the host time of save() goes (--profile-save)
            prof = cProfile.Profile()
            prof.enable()
            box["pending"] = ck.save(app, tag=tag)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
            print(f"  save() profile, {where} (tottime):\n" + text.getvalue()[-4000:], flush=True)
        elif loop.pipelined:
            box.update(save_on_device(loop, lambda: ck.save(app, tag=tag)))
        else:
            box["pending"] = ck.save(app, tag=tag)

    before = alloc_counts()
    t_save_step, peak = peak_extra(loop, lambda: loop.step(hook, where))
    host_step = loop.host_s
    mid = alloc_counts()
    interval = [t_save_step] + [loop.step() for _ in range(every - 1)]
    end = alloc_counts()
    interval_s = [seconds(t) for t in interval]  # (pipelined: waits for the device here)
    if full is not None:
        full.active = False  # the check below is the bench's, not the program's
    durable_in_interval = box["pending"].done()
    started = time.perf_counter()
    info = box["pending"].wait()
    wait_s = time.perf_counter() - started  # untimed by the steps: the bench waits here
    exact = verify(ck, loop, info, box.pop("expected"))
    if full is not None:
        full.active = True
    across = {}
    if "across" in box:  # (pipelined)
        a, b = box["across"]
        across = {"device_across_save_s": a.elapsed_time(b) / 1e3, "caught_up": box["caught_up"],
                  "syncs": box["syncs"]}
    # as it goes: a run killed at its time limit still shows the saves it made
    print(f"  {os.path.basename(ck.root)} {tag}: step {interval_s[0] * 1e3:.1f} ms (host {host_step * 1e3:.1f}), "
          f"interval {sum(interval_s) * 1e3:.1f} ms, save() {info.stats['stall_s'] * 1e3:.1f} ms, "
          f"window {info.stats['window_s'] * 1e3:.0f} ms, then waited {wait_s * 1e3:.0f} ms, exact {exact}"
          + (f"; device across save() {across['device_across_save_s'] * 1e3:.1f} ms, device caught up "
             f"{across['caught_up']}, syncs {across['syncs']}" if across else ""), flush=True)
    return {"info": info, "exact": exact, "step_s": interval_s[0], **across,
            "wait_s": wait_s, "durable_in_interval": durable_in_interval,
            "interval_s": sum(interval_s), "peak_extra": max(0, peak - plain_peak),
            # the save step's host time, until all of it was enqueued (pipelined: the clone's
            # host time and the sync debug mode's switching included)
            "host_step_s": host_step,
            # device mallocs/frees/retries of the caching allocator: in the save's
            # step, and in the rest of its interval
            "alloc_step": [b - a for a, b in zip(before, mid)],
            "alloc_rest": [b - a for a, b in zip(mid, end)]}


def save_on_device(loop: Loop, save: Callable[[], Any]) -> dict[str, Any]:
    """``save()`` in a pipelined step, watched from the device: events at its call and its
    return (the device time between them is the snapshot's copy, plus any time the device
    waited for the host), whether the device had already reached the call's event when
    save() returned (then the host was no longer ahead), and the synchronizing calls torch
    saw inside it (``torch.cuda.set_sync_debug_mode``; only those torch knows of; the mode
    and the warning hook are process-wide, so a gpusnap thread's call would count too, with
    that thread's stack)."""
    cuda = loop.dev.type == "cuda"
    enter, leave = loop.event(), loop.event()
    enter.record()
    stacks: list[str] = []

    def seen(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchroniz" in str(message):  # where the program's thread was (torch only names the op)
            stacks.append("".join(traceback.format_stack(limit=12)[:-2]))

    if cuda:  # (set before the watch: turning the mode on warns once itself)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen
        try:
            pending = save()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    caught_up = enter.query()
    leave.record()
    return {"pending": pending, "across": (enter, leave), "caught_up": caught_up,
            "syncs": len(stacks), "sync_stacks": stacks}


def finish_rows(rows: list[dict[str, Any]], full: FullCollections, every: int, median_rest: float) -> dict[str, Any]:
    """The rows' stalls against the median step at rest."""
    infos = [r["info"] for r in rows]
    out: dict[str, Any] = {"infos": infos, "rows": rows, "full_gc": (full.count, full.seconds),
                           "gen2_objects": full.objects, "gen2_census": full.census(),
                           "exact": all(r["exact"] for r in rows)}
    out["stalls"] = [max(0.0, r["step_s"] - median_rest) for r in rows]
    for r in rows:
        r["interval_stall"] = max(0.0, r["interval_s"] - every * median_rest)
    return out


def phase(loop: Loop, ck: gpusnap.Checkpointer, app: dict, where: str, saves: int, every: int,
          median_rest: float, plain_peak: int) -> dict[str, Any]:
    """``saves`` concurrent saves, one every ``every`` steps, placed at ``where``."""
    full = FullCollections().__enter__()
    rows = [one_save(loop, ck, app, where, f"{where}{s}", every, plain_peak, PROFILE_SAVE and s == saves - 1, full)
            for s in range(saves)]
    ck.wait()
    full.__exit__()
    return finish_rows(rows, full, every, median_rest)


def interleaved_phases(loop: Loop, cks: dict[str, gpusnap.Checkpointer], app: dict, where: str, saves: int,
                       every: int, median_rest: float, plain_peak: int) -> dict[str, dict[str, Any]]:
    """``phase`` for several configs at once (``--interleave``): round ``s`` saves once with
    each config, starting with config ``s mod n``, so that no config is always measured first
    or right after the same other one. Each config's saves are paired with the others' in
    time: what drifts during the run (the host, the collector's generations) drifts for all.
    Python's full collections are counted per config, in the intervals of its own saves."""
    keys = list(cks)
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in keys}
    fulls = {k: FullCollections() for k in keys}
    for s in range(saves):
        for key in keys[s % len(keys):] + keys[: s % len(keys)]:
            full = fulls[key].__enter__()
            rows[key].append(one_save(loop, cks[key], app, where, f"{where}{s}", every, plain_peak, full=full))
            full.__exit__()
    for ck in cks.values():
        ck.wait()
    return {k: finish_rows(rows[k], fulls[k], every, median_rest) for k in keys}


def alloc_counts() -> tuple[int, int, int]:
    """The caching allocator's device mallocs, frees and retries so far (0s on the CPU)."""
    if not torch.cuda.is_available():
        return (0, 0, 0)
    m = torch.cuda.memory_stats()
    return (m.get("num_device_alloc", 0), m.get("num_device_free", 0), m.get("num_alloc_retries", 0))


def summarize(ph: dict[str, Any]) -> dict[str, Any]:
    infos = ph["infos"]
    st = [i.stats for i in infos]
    return {
        "stalls_s": ph["stalls"],
        "gen2_objects": ph["gen2_objects"],
        "gen2_census": ph["gen2_census"],
        "interval_stalls_s": [r["interval_stall"] for r in ph["rows"]],
        "alloc_step": [r["alloc_step"] for r in ph["rows"]],
        "alloc_rest": [r["alloc_rest"] for r in ph["rows"]],
        "stall_median_s": statistics.median(ph["stalls"]),
        "stall_max_s": max(ph["stalls"]),
        "interval_stall_median_s": statistics.median(r["interval_stall"] for r in ph["rows"]),
        "save_call_s": statistics.median(s["stall_s"] for s in st),
        "window_s": statistics.median(s["window_s"] for s in st),
        "durable_s": statistics.median(s["duration_s"] for s in st),
        "bytes_cow_max": max(s["bytes_cow"] for s in st),
        "cow_peak_bytes_max": max(s.get("cow_peak_bytes", 0) for s in st),
        "waits_max": max(s["waits"] for s in st),
        "stream_waits_max": max(s.get("stream_waits", 0) for s in st),
        "peak_extra_device_bytes": max(r["peak_extra"] for r in ph["rows"]),
        "staging_bytes": max(s.get("staging_bytes", 0) for s in st),
        "ops_seen_median": statistics.median(s["ops_seen"] for s in st),
        "bytes_copied_median": statistics.median(s["bytes_copied"] for s in st),
        "bytes_skipped_median": statistics.median(s["bytes_skipped"] for s in st),
        "bytes_snapshot_max": max(s.get("bytes_snapshot", 0) for s in st),
        "copies_median": statistics.median(s.get("copies", 0) for s in st),
        "tracked_windows": sum(bool(s.get("tracked", True)) for s in st),
        "validation": st[-1].get("validation"),
        "full_gc_count": ph["full_gc"][0],  # Python's full collections during the saves' steps
        "full_gc_s": ph["full_gc"][1],
        "bit_exact": ph["exact"],
        "host_step_s": [r["host_step_s"] for r in ph["rows"]],
        "wait_s": [r["wait_s"] for r in ph["rows"]],
        "durable_in_interval": [r["durable_in_interval"] for r in ph["rows"]],
        "stats": [{k: v for k, v in s.items() if k != "access_order"} for s in st],
    }


def rest_host_and_syncs(loop: Loop) -> dict[str, Any]:
    """Host time of 5 plain steps (in a pipelined loop: whether the host runs ahead of the
    device, or waits for it somewhere), and the synchronizing calls torch sees in one step."""
    hosts = []
    for _ in range(5):
        loop.step()
        hosts.append(loop.host_s)
    out = save_on_device(loop, loop.step)
    loop.sync()
    for stack in out["sync_stacks"][:3]:
        print("a synchronizing call in a plain step, from:\n" + stack, flush=True)
    return {"host_s": hosts, "syncs": out["syncs"], "sync_stacks": out["sync_stacks"][:3]}


def tracker_overhead(loop: Loop) -> dict[str, float]:
    """Median step with the tracker installed over a window that never closes (no spans, so
    nothing to protect): the pure cost of intercepting every op, with and without read logs."""
    from gpusnap.capture.tracker import TrackerMode
    from gpusnap.capture.window import CaptureWindow
    from gpusnap.state.flatten import FlatState

    out = {}
    for log_reads in (False, True):
        window = CaptureWindow(FlatState({"t": "dict", "items": []}, []), order=[], cow_budget=0,
                               eager_cpu_bytes=0, log_reads=log_reads)
        with TrackerMode(window):
            steps = loop.steps(6)
        out["log_reads" if log_reads else "writes_only"] = statistics.median(steps[1:])
        out[("log_reads" if log_reads else "writes_only") + "_ops_per_step"] = window.stats.ops_seen / 6
    return out


_TARGET: dict[str, Any] = {}  # one model to restore into, built once per run


def verify(ck: gpusnap.Checkpointer, loop: Loop, info: Any, expected: list[torch.Tensor]) -> bool:
    """Restore ``info``'s checkpoint into a second model and optimizer; True when its bytes
    equal ``expected``, bit for bit."""
    if "app" not in _TARGET:
        fresh_model, fresh_optim = build(_TARGET["name"], loop.dev, seed=1)
        fresh_model(loop.data[:1], labels=loop.data[:1]).loss.backward()
        fresh_optim.step()
        _TARGET["app"] = {"model": fresh_model, "optim": fresh_optim, "step": -1}
    target = _TARGET["app"]
    ck.restore(target, info.id)
    got = clone_state(target["model"], target["optim"])
    ok = len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
    del got
    return ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--root", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-baselines", action="store_true")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() once the model is built (docs/capture.md): full collections then skip it")
    ap.add_argument("--interleave", action="store_true",
                    help="alternate the configs save by save (each with its own Checkpointer, the first "
                         "config rotating) instead of measuring one config after another: an A/B that "
                         "order and drift cannot bias")
    ap.add_argument("--pipelined", action="store_true",
                    help="no synchronization between steps (a loop that does not read the loss every step): "
                         "steps are timed on the device, and save()'s host time counts only where the device "
                         "waited for it")
    ap.add_argument("--profile-save", action="store_true",
                    help="cProfile the last save() of each placement and print its top functions")
    ap.add_argument("--configs", default=None,
                    help="Config variants measured one after another, e.g. 'io_threads=6;io_threads=12,copy_ahead=8'; "
                         "'_gather=0' (not a Config field) snapshots through _foreach_copy_ instead of the gather kernel")
    args = ap.parse_args()
    global PROFILE_SAVE
    PROFILE_SAVE = args.profile_save
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, optim = build(args.model, dev)
    data = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=dev)
    loop = Loop(model, optim, data, dev, pipelined=args.pipelined)
    _TARGET["name"] = args.model
    loop.steps(3)
    loop.expected_out()  # (allocated before any timed step)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    tensors = state_tensors(model, optim)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    rest_before = loop.steps(10)
    at_rest = rest_host_and_syncs(loop)
    print(f"at rest: host time per step {' '.join(f'{h * 1e3:.1f}' for h in at_rest['host_s'])} ms; "
          f"synchronizing calls in a step {at_rest['syncs']}", flush=True)
    median_rest = statistics.median(rest_before)
    _, plain_peak = peak_extra(loop, lambda: seconds(loop.step()))
    res_tracker = tracker_overhead(loop)
    host_parts = state_dict_costs(model, optim)
    print("host time at rest (median of 20): " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in host_parts.items()), flush=True)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = args.root or tempfile.mkdtemp(prefix="gpusnap-bench-", dir=shm)
    res: dict[str, Any] = {
        "model": args.model, "state_bytes": nbytes, "tensors": len(tensors), "median_step_s": median_rest,
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"), "batch": args.batch, "seq": args.seq,
        "tracker_step_s": res_tracker, "gc_freeze": args.gc_freeze, "host_parts_s": host_parts,
        "pipelined": loop.pipelined, "at_rest": at_rest,
    }
    if not args.skip_baselines:
        pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=dev.type == "cuda") for t in tensors]

        def stw_copy() -> None:
            for h, t in zip(pinned, tensors):
                h.copy_(t, non_blocking=True)

        res["stw_pinned_copy_s"] = min(timed(loop, stw_copy) for _ in range(3))
        del pinned
        path = os.path.join(root, "torch_save.pt")
        res["torch_save_s"] = timed(loop, lambda: torch.save({"m": model.state_dict(), "o": optim.state_dict()}, path))
        os.remove(path)
        print(f"baselines: stop-the-world {res['stw_pinned_copy_s'] * 1e3:.1f} ms, torch.save {res['torch_save_s'] * 1e3:.1f} ms", flush=True)

    app = {"model": model, "optim": optim, "step": 0}
    variants = [v for v in (args.configs or "").split(";") if v] or [""]
    parsed = []
    for variant in variants:
        key, cfg, switches = parse_variant(variant, [k for k, _, _ in parsed])
        parsed.append((key, cfg, switches))
        res.setdefault("configs", []).append(key)
        print(f"ck{len(parsed) - 1}: {key}", flush=True)
        res[key] = {"io_threads": cfg.io_threads, "copy_ahead": cfg.copy_ahead, "copy_piece_bytes": cfg.copy_piece_bytes}
    if args.interleave:
        if any(switches for _, _, switches in parsed):
            raise SystemExit("--interleave takes Config fields only: a '_' switch changes every config at once")
        run_interleaved(loop, app, parsed, res, args, root, median_rest, plain_peak)
    for n, (key, cfg, switches) in enumerate(parsed if not args.interleave else []):
        for name, on in switches.items():
            SWITCHES[name](bool(on))
        out = res[key]
        ck_root = os.path.join(root, f"ck{n}")
        # each save is checked before the next one: two retained checkpoints per config are
        # enough (with one per save, two GPT-2 large configs would not fit the host's tmpfs)
        with gpusnap.Checkpointer(ck_root, config=cfg, keep_last=2) as ck:
            if not args.skip_baselines and n == 0:
                res["gpusnap_blocking_s"] = timed(loop, lambda ck=ck: ck.save(app, blocking=True))
            first_save(loop, ck, app, out, args.every, median_rest, plain_peak)
            for where in ("after", "cow"):
                out[where] = summarize(phase(loop, ck, app, where, args.saves, args.every, median_rest, plain_peak))
            ck.wait()
            ck.list()  # a gpusnap call on this thread: pops any closed window's tracker
        # each config's checkpoints go: on tmpfs, four configs of GPT-2 large filled the host
        # memory (the H200 machine's 128 GiB) and the kernel killed the run
        shutil.rmtree(ck_root, ignore_errors=True)
        for name in switches:
            SWITCHES[name](True)  # back to the default for the next config
        report_config(key, out)
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as _stack
    res["modes_at_rest"] = [type(m).__name__ for m in _stack()]  # must be empty
    if args.root is None:
        shutil.rmtree(root, ignore_errors=True)
    rest_after = loop.steps(10)
    res["median_step_after_s"] = statistics.median(rest_after)
    res["at_rest_change"] = res["median_step_after_s"] / median_rest - 1
    res["step_stdev_s"] = statistics.pstdev(rest_before)
    print(json.dumps(res, indent=1, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    table(res)


def parse_variant(variant: str, taken: list[str]) -> tuple[str, gpusnap.Config, dict[str, int]]:
    """``"field=v,_switch=0"`` -> (result key, Config, benchmark switches); a config given
    again gets ``#2``, ``#3`` on its key."""
    defaults = gpusnap.Config()
    pairs = [kv.split("=") for kv in variant.split(",") if kv]
    switches = {k: int(v) for k, v in pairs if k.startswith("_")}  # not Config fields: SWITCHES
    overrides = {
        k: (bool(int(v)) if isinstance(getattr(defaults, k), bool) else int(v))
        for k, v in pairs if not k.startswith("_")
    }
    key = variant or "gpusnap"
    if key in taken:  # a config measured again later in the run
        key += f" #{sum(k.split(' #')[0] == key for k in taken) + 1}"
    return key, gpusnap.Config.from_env(**overrides), switches


def first_save(loop: Loop, ck: gpusnap.Checkpointer, app: dict, out: dict[str, Any], every: int,
               median_rest: float, plain_peak: int) -> None:
    """The first concurrent save grows the staging arena (pinned memory): measured alone."""
    first = phase(loop, ck, app, "after", 1, every, median_rest, plain_peak)
    out["first_save_stall_s"] = first["stalls"][0]
    out["first_save_phases_s"] = first["infos"][0].stats.get("save_phases_s")
    out["first_exact"] = first["exact"]


def run_interleaved(loop: Loop, app: dict, parsed, res: dict[str, Any], args, root: str,
                    median_rest: float, plain_peak: int) -> None:
    """``--interleave``: every config's Checkpointer open at once, their saves alternated
    (``interleaved_phases``)."""
    with contextlib.ExitStack() as stack:
        cks = {key: stack.enter_context(gpusnap.Checkpointer(os.path.join(root, f"ck{n}"), config=cfg, keep_last=2))
               for n, (key, cfg, _) in enumerate(parsed)}
        if not args.skip_baselines:
            first_ck = next(iter(cks.values()))
            res["gpusnap_blocking_s"] = timed(loop, lambda: first_ck.save(app, blocking=True))
        for key, ck in cks.items():
            first_save(loop, ck, app, res[key], args.every, median_rest, plain_peak)
        for where in ("after", "cow"):
            phases = interleaved_phases(loop, cks, app, where, args.saves, args.every, median_rest, plain_peak)
            for key, ck in cks.items():
                res[key][where] = summarize(phases[key])
        for ck in cks.values():
            ck.wait()
            ck.list()  # pops any closed window's tracker
    for n, (key, _, _) in enumerate(parsed):
        shutil.rmtree(os.path.join(root, f"ck{n}"), ignore_errors=True)
        report_config(key, res[key])


def report_config(key: str, out: dict[str, Any]) -> None:
    print(f"[{key}] stall after/cow {out['after']['stall_median_s'] * 1e3:.1f}/{out['cow']['stall_median_s'] * 1e3:.1f} ms, "
          f"interval {out['after']['interval_stall_median_s'] * 1e3:.1f}/{out['cow']['interval_stall_median_s'] * 1e3:.1f} ms, "
          f"exact {out['first_exact'] and out['after']['bit_exact'] and out['cow']['bit_exact']}", flush=True)


def _gather(on: bool) -> None:
    """``_gather=0``: snapshots through one ``_foreach_copy_`` of per-span views (the path
    before kernels.gather_copy), for an A/B in one run."""
    from gpusnap.capture import window
    from gpusnap.kernels import gather_copy

    window.gather_copy_available = gather_copy.gather_copy_available if on else (lambda device: False)


# Benchmark switches, given in --configs as "_name=0/1" next to Config fields.
SWITCHES = {"_gather": _gather}


def table(res: dict[str, Any]) -> None:
    ms = lambda v: f"{v * 1e3:.1f} ms" if isinstance(v, (int, float)) else str(v)
    gb = lambda v: f"{v / 1e9:.2f} GB" if isinstance(v, (int, float)) else str(v)
    print(f"\n{res['model']}: {gb(res['state_bytes'])} in {res['tensors']} tensors; "
          f"median step {ms(res['median_step_s'])} (after: {ms(res['median_step_after_s'])}, "
          f"at-rest change {res['at_rest_change'] * 100:+.2f}%, stdev {ms(res['step_stdev_s'])}; "
          f"{'pipelined: steps timed on the device' if res['pipelined'] else 'steps synchronized'})")
    for k in ("stw_pinned_copy_s", "torch_save_s", "gpusnap_blocking_s"):
        if k in res:
            print(f"  {k:<28}{ms(res[k]):>14}")
    t = res["tracker_step_s"]
    print(f"  tracker installed, step: writes only {ms(t['writes_only'])}, logging reads {ms(t['log_reads'])}, "
          f"{t['writes_only_ops_per_step']:.0f} ops/step")
    keys = ("stall_median_s", "stall_max_s", "interval_stall_median_s", "save_call_s", "window_s",
            "durable_s", "bytes_cow_max", "waits_max", "stream_waits_max", "peak_extra_device_bytes",
            "staging_bytes", "bytes_copied_median", "bytes_skipped_median", "bytes_snapshot_max",
            "copies_median", "tracked_windows", "full_gc_count", "full_gc_s", "bit_exact")
    lists = ("stalls_s", "interval_stalls_s", "host_step_s", "wait_s", "durable_in_interval", "alloc_step", "alloc_rest", "gen2_objects", "gen2_census")
    for key in res["configs"]:
        c = res[key]
        print(f"  [{key}] first save stall {ms(c['first_save_stall_s'])}, exact {c['first_exact']}")
        for where in ("after", "cow"):
            ph = c[where]["stats"][-1].get("save_phases_s", {})
            print(f"  [{key}] save() phases, {where}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in ph.items()))
        print(f"  {'[' + key + ']':<28}{'after step':>14}{'cow-heavy':>14}")
        for k in keys:
            a, b = c["after"][k], c["cow"][k]
            fmt = ms if k.endswith("_s") else (gb if "bytes" in k else str)
            print(f"  {k:<28}{fmt(a):>14}{fmt(b):>14}")
        for k in lists:  # per save: the spread behind the medians, and the allocator's work
            for where in ("after", "cow"):
                vals = c[where].get(k, [])
                shown = [f"{v * 1e3:.1f}" for v in vals] if k.endswith("_s") else [str(v) for v in vals]
                print(f"  [{key}] {k} {where}: {' '.join(shown)}")


if __name__ == "__main__":
    main()
