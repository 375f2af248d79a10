"""One pool process, from its start to its exit (started by ``child.Child``, which passes it
one end of a socket pair; the messages are ``messages``'s).

    start message -> prepare (imports, CUDA context, model built and warmed) -> "ready"
    wait for "take" (the pool's end closing instead: exit 0, nothing served)
    load (the weights, in place, checked) -> "loaded" -> entry(Ready) -> "returned" -> exit 0

Whatever fails before the entry runs is reported ("failed", with the stage) and ends the
process with status 1: a process whose load failed, or that could not say its weights are
in place, never calls the entry. Once serving, the process kills itself (SIGKILL), with what
the entry started in its process group, when its pool's end of the pair closes without a
word: the pool's process is gone, and a pool's processes do not outlive it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

from gpusnap.pool.faults import Fault
from gpusnap.pool.messages import error_of, recv, send, to_json

__all__ = ["BOOT", "main"]

# what the pool runs: the pool's own sys.path first (an entry module the pool can import, its
# processes can), then this module
BOOT = ("import time; started = time.perf_counter(); import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
        "from gpusnap.pool.worker import main; sys.exit(main(int(sys.argv[2]), started))")


def main(fd: int, started: float) -> int:
    """The process's life (``started``: ``time.perf_counter()`` before its first import); its
    exit status."""
    os.set_inheritable(fd, False)  # (the entry's own children must not hold the pool's channel)
    sock = socket.socket(fileno=fd)
    start = recv(sock)
    if start is None or start.get("op") != "start":
        return 2
    fault = Fault.from_env()
    seq = int(start.get("seq", 0))
    try:
        from gpusnap.pool.warm import prepare

        warm = prepare(start, started)
    except BaseException as exc:  # noqa: BLE001 (an import, a build, a busy device: all reported)
        return _report(sock, "start", exc)
    fault.maybe_die("starting", seq)
    try:
        send(sock, {"op": "ready", "pid": os.getpid(), "device": str(warm.device), **warm.timings})
    except OSError:
        return 1  # the pool is gone
    take = recv(sock)
    if take is None or take.get("op") != "take":
        return 0  # the pool closed before anyone asked: nothing served
    asked_at = time.perf_counter()
    try:
        from gpusnap.pool.warm import load

        checkpoint, stats = load(warm, take.get("checkpoint"))
    except BaseException as exc:  # noqa: BLE001 (a mismatch, a corrupt chunk, a missing checkpoint)
        return _report(sock, "load", exc)
    fault.maybe_die("loading", seq)
    loaded_at = time.perf_counter()
    try:
        send(sock, {"op": "loaded", "checkpoint": checkpoint,
                    "stats": ["garbled"] if fault.garbles(seq) else to_json(stats)})
    except OSError:
        return 1  # nobody took it after all: serve nothing
    threading.Thread(target=_die_with_pool, args=(sock,), name="gpusnap-pool-watch", daemon=True).start()
    from gpusnap.pool.ready import Ready

    ready = Ready(warm.model, warm.device, checkpoint, take.get("params") or {}, stats, asked_at, loaded_at)
    try:
        value = warm.serve(ready)
    except SystemExit as exc:  # (the entry's own exit status stands)
        if exc.code in (None, 0):
            _say(sock, {"op": "returned", "value": None})
        else:
            _report(sock, "serve", exc)
        raise
    except BaseException as exc:  # noqa: BLE001 (the entry's own error: shown here, and reported)
        traceback.print_exc()
        return _report(sock, "serve", exc)
    try:
        body = json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        return _report(sock, "serve", TypeError(f"the entry returned a value JSON cannot hold ({exc})"))
    _say(sock, {"op": "returned", "value": body})
    return 0


def _say(sock: socket.socket, msg: dict[str, Any]) -> None:
    try:
        send(sock, msg)
    except OSError:  # (the pool is gone: nobody to tell)
        pass


def _report(sock: socket.socket, stage: str, exc: BaseException) -> int:
    try:
        send(sock, {"op": "failed", "stage": stage, "error": error_of(exc)})
    except OSError:
        print(f"gpusnap pool process {os.getpid()}: {stage} failed: {exc!r}", file=sys.stderr)
    return 1


def _die_with_pool(sock: socket.socket) -> None:
    """Until the pool's end closes (the pool says nothing more to a process it handed out)."""
    while recv(sock) is not None:
        pass
    # with what the entry started in the process's group (its session's own: ``child.Child``),
    # as the pool's close() stops it: nothing of a taken process outlives its pool
    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)

