"""A light sampling profiler for the benchmarks: where a short stretch of wall time goes, in
every thread, without cProfile's per-call cost (which would double a 50 ms handoff). It
still takes the GIL every ``interval_s``: times measured while it runs are a little longer
than without it, so a benchmark reports those of a run without it.

A daemon thread reads ``sys._current_frames()`` every ``interval_s``; :meth:`report` counts,
per function, the samples whose stack holds it (inclusive) and those where it is innermost
(self), over the samples taken between two times. Waiting threads show their wait.

    sampler = StackSampler().start()
    t0 = time.monotonic(); work(); t1 = time.monotonic()
    print("\\n".join(sampler.stop().report(t0, t1)))
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter

__all__ = ["StackSampler"]

# innermost frames of a thread that waits (not shown unless it also works)
WAITS = {"threading.py:wait", "queue.py:get", "selectors.py:select", "thread.py:_worker", "threading.py:_wait_for_tstate_lock"}


class StackSampler:
    def __init__(self, interval_s: float = 0.002, depth: int = 30) -> None:
        self.interval_s = interval_s
        self.depth = depth
        self.samples: list[tuple[float, tuple[tuple[str, tuple[str, ...]], ...]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def stop(self) -> StackSampler:
        self._stop.set()
        self._thread.join()
        return self

    def _run(self) -> None:
        me = threading.get_ident()
        names = {}
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            frames = sys._current_frames()
            if any(ident not in names for ident in frames):  # (a new thread, or an ident reused)
                names = {t.ident: t.name for t in threading.enumerate()}
            stacks = []
            for ident, frame in frames.items():
                if ident == me:
                    continue
                funcs = []
                while frame is not None and len(funcs) < self.depth:
                    code = frame.f_code
                    funcs.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
                    frame = frame.f_back
                stacks.append((names.get(ident, str(ident)), tuple(funcs)))
            self.samples.append((now, tuple(stacks)))

    def report(self, start: float, end: float, top: int = 25) -> list[str]:
        """Lines: per thread with samples in [start, end], its top functions (inclusive, self)."""
        picked = [s for t, s in self.samples if start <= t <= end]
        lines = [f"{len(picked)} samples over {1e3 * (end - start):.1f} ms (every {1e3 * self.interval_s:.2f} ms)"]
        threads: dict[str, tuple[Counter[str], Counter[str]]] = {}
        for stacks in picked:
            for name, funcs in stacks:
                inclusive, own = threads.setdefault(name, (Counter(), Counter()))
                inclusive.update(set(funcs))
                if funcs:
                    own[funcs[0]] += 1
        for name, (inclusive, own) in sorted(threads.items(), key=lambda kv: kv[0]):
            if name != "MainThread" and sum(n for f, n in own.items() if f not in WAITS) < 2:  # (an idle thread)
                continue
            lines.append(f"-- thread {name}: inclusive / self samples")
            for func, n in inclusive.most_common(top):
                lines.append(f"   {n:5d} {own.get(func, 0):5d}  {func}")
        return lines
