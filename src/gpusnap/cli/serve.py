"""``gpusnap serve ROOT``: the resident restore server (``gpusnap.serving``, docs/serve.md).

Prints one line per event on stdout (``--json``: one JSON object per line, ``{"event":
"ready", ...}`` first once the newest checkpoints are held) and runs until SIGTERM or SIGINT,
then exits 0 having removed its socket.

``--pool N --entry module:function`` also keeps N warm processes of the entry
(``gpusnap.pool``, docs/pool.md), started once the server is ready; ``gpusnap.pool.take_from(ROOT)``
hands one of them a checkpoint. Their events (``pool-ready``, ``pool-loaded``, ...) join the
server's; what the processes print goes to stderr, so that stdout holds events only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from typing import Any

from gpusnap.cli.exits import EXIT_ERROR, EXIT_OK

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser("serve", help="hold ROOT's newest checkpoints in page-locked memory: fresh processes restore "
                       "from it at host-to-device speed")
    s.add_argument("root", help="checkpoint root (a local directory; it may not exist yet)")
    s.add_argument("--keep", type=int, default=1, metavar="N", help="hold the N newest checkpoints (default 1)")
    s.add_argument("--device", default=None, help="the GPU to copy to (default cuda:0 if present, else cpu: host only)")
    s.add_argument("--socket", default=None, help="listen here (default: derived from ROOT, docs/serve.md)")
    s.add_argument("--poll", type=float, default=1.0, metavar="S", help="look for new checkpoints every S seconds")
    s.add_argument("--json", action="store_true", help="one JSON object per event line")
    s.add_argument("--pool", type=int, default=0, metavar="N",
                   help="also keep N warm processes of --entry ready to serve (docs/pool.md)")
    s.add_argument("--entry", default=None, metavar="MODULE:FUNCTION",
                   help="the pool's entry function (importable from the working directory or sys.path)")


def _line(event: dict[str, Any]) -> str:
    kind = event.get("event")
    if kind == "ready":
        held = ", ".join(f"{h['id']} ({h['bytes'] / 1e9:.2f} GB{'' if h['pinned'] else ', pageable'})"
                         for h in event["held"]) or "nothing yet"
        return (f"gpusnap serve: serving {event['root']} on {event['socket']} (pid {event['pid']}, "
                f"{event['device']}); holds {held}")
    if kind == "held":
        return f"held {event['id']}: {event['bytes'] / 1e9:.2f} GB in {event['load_s']:.2f} s"
    if kind == "served":
        return f"served {event['id']} to pid {event['pid']}: {event['bytes'] / 1e9:.3f} GB in {event['copy_s']:.3f} s"
    if kind == "pool-ready":
        return f"pool process {event['pid']} ready on {event['device']} after {event['start_s']:.1f} s"
    if kind == "pool-loaded":
        return (f"pool process {event['pid']} serves {event['checkpoint']} (from {event['source']}, "
                f"{event['take_s']:.3f} s)")
    detail = event.get("why") or event.get("id") or ""
    return f"{kind}{' ' if detail else ''}{detail}" + (f" (pid {event['pid']})" if "pid" in event else "")


def run(args: argparse.Namespace) -> int:
    from gpusnap.serving import serve

    printing = threading.Lock()  # (events come from several threads: one whole line each)

    def show(event: dict[str, Any]) -> None:
        text = (json.dumps(event) if args.json else _line(event)) + "\n"
        with printing:
            sys.stdout.write(text)
            sys.stdout.flush()

    if args.keep < 1:
        raise ValueError("--keep must be at least 1")
    if (args.pool != 0) != (args.entry is not None):
        raise ValueError("--pool N and --entry MODULE:FUNCTION go together")
    try:
        if args.entry is not None:
            from gpusnap.pool.serve import serve_pool

            if os.getcwd() not in sys.path:  # (an entry module in the working directory, as `python -m` finds it)
                sys.path.insert(0, os.getcwd())
            serve_pool(args.root, args.entry, args.pool, keep=args.keep, device=args.device, socket=args.socket,
                       poll_s=args.poll, stdout=2, on_event=show)  # (fd 2: stdout holds events only)
        else:
            serve(args.root, keep=args.keep, device=args.device, socket=args.socket, poll_s=args.poll, on_event=show)
    except RuntimeError as exc:  # another server holds the root; a device that broke
        print(f"gpusnap: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK
