"""``gpusnap serve ROOT``: the resident restore server (``gpusnap.serving``, docs/serve.md).

Prints one line per event on stdout (``--json``: one JSON object per line, ``{"event":
"ready", ...}`` first once the newest checkpoints are held) and runs until SIGTERM or SIGINT,
then exits 0 having removed its socket.
"""

from __future__ import annotations

import argparse
import json
import sys
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
    detail = event.get("why") or event.get("id") or ""
    return f"{kind}{' ' if detail else ''}{detail}" + (f" (pid {event['pid']})" if "pid" in event else "")


def run(args: argparse.Namespace) -> int:
    from gpusnap.serving import serve

    def show(event: dict[str, Any]) -> None:
        print(json.dumps(event) if args.json else _line(event), flush=True)

    if args.keep < 1:
        raise ValueError("--keep must be at least 1")
    try:
        serve(args.root, keep=args.keep, device=args.device, socket=args.socket, poll_s=args.poll, on_event=show)
    except RuntimeError as exc:  # another server holds the root; a device that broke
        print(f"gpusnap: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK
