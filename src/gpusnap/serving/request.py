"""One restore request, in the server: check it all, copy, answer once the bytes are in place.

The request names a checkpoint by id and manifest digest; the server serves only a held
checkpoint with that digest (its chunks were checked against the manifest when it was
loaded). Every copy's source and destination range is checked before the first byte moves;
then the copies run in destination order (a device allocation is opened at its first copy,
so the next one opens while the copy engine works), and the reply goes out after every copy
has completed. A failure after some copies answers an error: the client then restores from
the files, rewriting everything.

``Fault`` is a test hook (``GPUSNAP_SERVE_FAULT=die-after=N`` or ``stall-after=N``): the
server kills itself, or stops answering, once it has copied at least N bytes of a request.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from gpusnap.restore.via_server.cuda_ipc import CudaError
from gpusnap.serving.cuda_runtime import Runtime
from gpusnap.serving.dests import DestError, Destinations
from gpusnap.serving.holdings import Holdings

__all__ = ["BrokenDevice", "Fault", "serve_restore"]


class BrokenDevice(RuntimeError):
    """A copy failed in CUDA: the server's context may be unusable; the server stops."""


@dataclass(frozen=True)
class Fault:
    action: str  # "die" or "stall"
    after: int  # bytes copied first

    @classmethod
    def from_env(cls) -> Fault | None:
        raw = os.environ.get("GPUSNAP_SERVE_FAULT", "")
        action, _, n = raw.partition("-after=")
        if action not in ("die", "stall") or not n.isdigit():
            return None
        return cls(action, int(n))

    def hit(self, copied: int) -> None:
        if copied < self.after:
            return
        if self.action == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Event().wait()  # (stall: until the process is killed)


def _refusal(code: str, why: str) -> dict[str, Any]:
    return {"ok": False, "code": code, "why": why}


def serve_restore(msg: dict[str, Any], fds: list[int], holdings: Holdings, runtime: Runtime | None,
                  fault: Fault | None) -> dict[str, Any]:
    """The reply to a ``restore`` request; raises :class:`BrokenDevice` after a CUDA copy
    failed (the error reply is then the caller's to send)."""
    cid, digest = msg.get("id"), msg.get("digest")
    held = holdings.get(cid) if isinstance(cid, str) else None
    if held is None:
        return _refusal("not-held", f"this server does not hold checkpoint {cid!r} (it holds "
                        f"{', '.join(holdings.digests()) or 'none yet'})")
    if digest != held.digest:
        return _refusal("mismatch", f"checkpoint {cid}'s manifest here has digest {held.digest}, not {digest!r}")
    try:
        dests = Destinations(msg.get("dests"), fds, runtime)
    except (DestError, OSError) as exc:
        return _refusal("bad-request", str(exc))
    try:
        try:
            plan = _plan(msg.get("copies"), held, dests)
            started = time.perf_counter()
            copied = 0
            queue_s = 0.0
            for src, k, offset, length in plan:
                before = time.perf_counter()
                dests.copy(k, offset, src, length)
                queue_s += time.perf_counter() - before  # (with opening each allocation at its first copy)
                copied += length
                if fault is not None:
                    fault.hit(copied)
            dests.wait()
            copy_s = time.perf_counter() - started
        finally:
            dests.close()  # (always, and first: no copy may still run once the client hears back)
    except (DestError, ValueError) as exc:
        return _refusal("bad-request", str(exc))
    except CudaError as exc:
        raise BrokenDevice(str(exc)) from exc
    return {"ok": True, "id": held.id, "digest": held.digest, "bytes": copied, "device_bytes": dests.device_bytes,
            "queue_s": round(queue_s, 6), "copy_s": round(copy_s, 6), "pinned": held.pinned}


def _plan(copies: Any, held: Any, dests: Destinations) -> list[tuple[int, int, int, int]]:
    """``(source address, dest, dest offset, length)`` per copy, every range checked, in
    destination order; ``ValueError`` / ``DestError`` for the first bad one."""
    if not isinstance(copies, list):
        raise DestError("copies must be a list")
    plan = []
    for c in copies:
        if not (isinstance(c, list) and len(c) == 5 and all(type(v) is int for v in c)):
            raise DestError(f"a copy is malformed: {c!r:.80}")
        span, span_offset, length, k, offset = c
        dests.check(k, offset, length)
        plan.append((held.address(span, span_offset, length), k, offset, length))
    plan.sort(key=lambda p: (p[1], p[2]))
    return plan
