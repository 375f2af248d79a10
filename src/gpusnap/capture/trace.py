"""An optional timeline of one capture window, written as Chrome/Perfetto trace JSON.

Enabled by ``Config.trace_dir`` (``GPUSNAP_TRACE_DIR``): each concurrent save then writes
``<trace_dir>/<checkpoint id>.trace.json`` and names it in ``stats["trace_path"]``. Open it in
https://ui.perfetto.dev or chrome://tracing. Tracks: ``program`` (every op the tracker saw,
an instant each), ``copy`` (each piece, from issue to observed completion), ``cow`` (shadow
copies), ``wait`` (the program blocked on the copier), ``store`` (hash + write of a chunk),
``copier`` (the copier thread's own stops: preparing hashes, finding unchanged chunks,
waiting for a copy to complete).
Times are CPU times (``perf_counter``) relative to the window's opening; the end of a CUDA
copy is when the copier saw its event complete, so it can be late by up to one piece.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

__all__ = ["Trace"]

_TRACKS = ("program", "copy", "cow", "wait", "store", "copier")


class Trace:
    """Thread-safe event recorder; ``write`` dumps the trace-event JSON."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.origin = time.perf_counter()
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def _us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 3)

    def instant(self, track: str, name: str, at: float) -> None:
        event = {"name": name, "ph": "i", "s": "t", "ts": self._us(at), "pid": 1, "tid": _tid(track)}
        with self._lock:
            self._events.append(event)

    def span(self, track: str, name: str, start: float, end: float, **args: Any) -> None:
        event = {
            "name": name,
            "ph": "X",
            "ts": self._us(start),
            "dur": max(0.0, round((end - start) * 1e6, 3)),
            "pid": 1,
            "tid": _tid(track),
        }
        if args:
            event["args"] = args
        with self._lock:
            self._events.append(event)

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events)

    def write(self, path: str) -> str:
        meta = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"gpusnap {self.name}"}}]
        meta += [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": _tid(t), "args": {"name": t}} for t in _TRACKS
        ]
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"traceEvents": meta + self.events(), "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)
        return path


def _tid(track: str) -> int:
    return _TRACKS.index(track) + 1 if track in _TRACKS else len(_TRACKS) + 1
