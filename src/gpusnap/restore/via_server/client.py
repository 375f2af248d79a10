"""A restore asks the root's restore server first (``Config.restore_from_server``).

Call order (``Restorer.restore``, after the plan, before any path that reads files)::

    outcome = client.restore(repo, manifest, plan, original=m)  # served: every byte in place
    handle.stats.update(outcome.stats)                        # else: restore from files

The exchange (``via_server.protocol``): connect (``CONNECT_TIMEOUT_S``), check the server is
this user's (``SO_PEERCRED``), read its hello (does it hold this checkpoint id, with this
manifest digest, for which GPU), send one request (``request.ServerRequest``), read
the reply (at most ``REPLY_TIMEOUT_S`` plus a second per GB), check it names the same id and
digest and every byte, apply what landed on the host. The server checked every chunk's
BLAKE2b digest when it loaded the checkpoint; its reply comes once its copies completed.

Anything else, and the restore reads files as it always did, with the same errors: no
server, a stale socket, a server that holds another checkpoint, refuses, dies, stops
answering or answers nonsense. No target is left half-filled by a server: the fallback
rewrites every span. A server that wrote into this process's device memory and then failed
is waited for until its process is gone (``GONE_TIMEOUT_S``), and one that stops answering
is killed first, so that none of its copies can land after the fallback's. ``auto`` warns
(``RuntimeWarning``, once per reason and Checkpointer) unless no server runs for the root;
``on`` warns then too.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from gpusnap.restore.via_server import connection, paths, protocol
from gpusnap.restore.via_server.cuda_ipc import CudaError
from gpusnap.restore.via_server.request import ServerRequest
from gpusnap.state.plan import RestorePlan
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.repository import Repository

__all__ = ["Outcome", "ServerClient"]

CONNECT_TIMEOUT_S = 1.0  # a live server accepts at once (its own thread does nothing else)
HELLO_TIMEOUT_S = 5.0
REPLY_TIMEOUT_S = 60.0  # plus a second per GB: the copies run at tens of GB/s
GONE_TIMEOUT_S = 10.0  # a server that failed mid-copy: its process is gone by then
MODES = ("auto", "on", "off")


class _NotServed(Exception):
    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind = kind  # "absent", "refused", "failed"


@dataclass(frozen=True)
class Outcome:
    """``served``: every byte is in place. Else ``kind`` and ``reason`` say why not;
    ``stats`` goes into the restore handle's (``source``, ``served`` or ``server_fallback``)."""

    served: bool
    kind: str = ""
    reason: str = ""
    stats: dict[str, Any] = field(default_factory=dict)


class ServerClient:
    """One Checkpointer's way to its roots' restore servers: ``mode`` (auto, on, off) and an
    optional ``socket`` path that overrides the one derived from the root."""

    def __init__(self, mode: str = "auto", socket: str = "") -> None:
        if mode not in MODES:
            raise ValueError(f"restore_from_server must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.socket = socket
        self._warned: set[str] = set()

    def restore(self, repo: Repository, manifest: Manifest, plan: RestorePlan, *, original: Manifest) -> Outcome:
        """Have the server fill ``plan``'s targets with ``manifest``'s spans (``original``: the
        checkpoint's manifest as committed, which ``manifest`` may have emptied spans of for
        ``strict=False``; it names the checkpoint to the server); see the module docstring."""
        if self.mode == "off":
            return Outcome(False, "off", "restore_from_server is off", {"source": "files"})
        started = time.perf_counter()
        try:
            stats = self._exchange(repo, manifest, original, plan)
        except _NotServed as exc:
            outcome = Outcome(False, exc.kind, str(exc), {"source": "files", "server_fallback": str(exc)})
            self._warn(outcome, repo)
            return outcome
        stats["total_s"] = time.perf_counter() - started
        return Outcome(True, stats={"source": "server", "served": stats})

    def _warn(self, outcome: Outcome, repo: Repository) -> None:
        if (outcome.kind == "absent" and self.mode == "auto") or outcome.kind in self._warned:
            return
        self._warned.add(outcome.kind)
        warnings.warn(f"gpusnap: the restore server of {repo.root} did not serve this restore ({outcome.reason}); "
                      "restoring from files", RuntimeWarning, stacklevel=5)

    # -- the exchange ------------------------------------------------------------------------
    def _exchange(self, repo: Repository, manifest: Manifest, original: Manifest, plan: RestorePlan) -> dict[str, Any]:
        root = repo.local_path("")
        if root is None:
            raise _NotServed("absent", "the root is not a local directory")
        if manifest.nbytes == 0:
            raise _NotServed("absent", "nothing to copy")
        path = self._socket_path(root)
        started = time.perf_counter()
        conn, pid = _connect(path)
        with conn:
            try:
                hello = connection.read_hello(conn, time.monotonic() + HELLO_TIMEOUT_S)
            except TimeoutError:
                raise _NotServed("failed", "the server sent no hello in time") from None
            except OSError as exc:
                raise _NotServed("failed", f"the server failed before its hello ({exc})") from None
            digest = original.digest()
            try:
                _check_hello(hello, paths.real_root(root), manifest.id, digest)
            except _NotServed:
                _tell_missed(conn, manifest.id)
                raise
            connect_s = time.perf_counter() - started
            try:
                request = ServerRequest(manifest, plan, server_bus_id=hello.get("device"))
            except (OSError, CudaError) as exc:  # (no shared memory, a device call refused)
                raise _NotServed("failed", f"the request could not be made ({exc})") from exc
            try:
                for device in request.devices:  # its copies bypass this process's streams
                    torch.cuda.synchronize(device)
                built = time.perf_counter()
                reply = self._ask(conn, pid, request, manifest.id, digest)
                replied = time.perf_counter()
                _check_reply(reply, manifest.id, digest, request.copy_bytes)
                request.apply_landed()
                request.mark_written()
            finally:
                request.close()
        return {"pid": pid, "socket": path, "bytes": request.copy_bytes, "direct_bytes": request.direct_bytes,
                "landed_bytes": request.copy_bytes - request.direct_bytes, "handles": request.handles,
                "ipc_refused": request.ipc_refused, "connect_s": connect_s, "request_s": built - started - connect_s,
                "reply_s": replied - built, "server_copy_s": reply.get("copy_s"), "apply_s": time.perf_counter() - replied}

    def _socket_path(self, root: str) -> str:
        if self.socket:
            return self.socket
        try:
            path = paths.socket_path(root)
        except FileNotFoundError:
            raise _NotServed("absent", "no restore server runs on this machine") from None
        except OSError as exc:  # (not private: no server of ours can listen there)
            raise _NotServed("absent", str(exc)) from None
        if not os.path.exists(path):
            raise _NotServed("absent", "no restore server for this root")
        return path

    def _ask(self, conn: socket.socket, pid: int, request: ServerRequest, checkpoint_id: str, digest: str) -> Any:
        """Send the request, read the reply; on any failure make sure the server writes
        nothing more into this process's memory before the fallback does."""
        try:
            protocol.send_msg(conn, request.message(checkpoint_id, digest), request.fds)
            request.sent()
            return _recv(conn, time.monotonic() + REPLY_TIMEOUT_S + request.copy_bytes / 1e9, "reply")
        except _NotServed as exc:
            if request.direct_spans:
                _until_gone(pid, kill=isinstance(exc.__cause__, TimeoutError))
            raise
        except OSError as exc:  # (the request could not be sent: the server is going away)
            if request.direct_spans:
                _until_gone(pid, kill=False)
            raise _NotServed("failed", f"the server went away ({exc})") from exc


def _connect(path: str) -> tuple[socket.socket, int]:
    try:
        return connection.connect(path, timeout=CONNECT_TIMEOUT_S)
    except (ConnectionRefusedError, FileNotFoundError):
        raise _NotServed("absent", "no restore server answers (a stale socket)") from None
    except PermissionError as exc:
        raise _NotServed("refused", str(exc)) from None
    except OSError as exc:  # (a timeout, a full backlog)
        raise _NotServed("failed", f"connecting to {path} failed ({exc})") from None


def _recv(conn: socket.socket, deadline: float, what: str) -> Any:
    try:
        msg, fds = protocol.recv_msg(conn, deadline)
    except TimeoutError as exc:
        raise _NotServed("failed", f"the server sent no {what} in time") from exc
    except OSError as exc:  # (ProtocolError: it closed the connection, or sent garbage)
        raise _NotServed("failed", f"the server failed before its {what} ({exc})") from exc
    for fd in fds:
        os.close(fd)
    if not isinstance(msg, dict):
        raise _NotServed("failed", f"the server sent {msg!r:.60} as {what}")
    return msg


def _tell_missed(conn: socket.socket, checkpoint_id: str) -> None:
    """Tell the server it was asked for what it does not hold: it looks for new commits now,
    not at its next poll (no answer is awaited)."""
    try:
        protocol.send_msg(conn, {"op": "missed", "id": checkpoint_id})
    except OSError:
        pass


def _check_hello(hello: dict[str, Any], root: str, checkpoint_id: str, digest: str) -> None:
    if hello.get("busy"):
        raise _NotServed("refused", f"the server is busy ({hello['busy']})")
    if hello.get("root") != root:
        raise _NotServed("refused", f"the server serves {hello.get('root')!r}, not {root}")
    held = hello.get("held")
    held = held if isinstance(held, dict) else {}
    if checkpoint_id not in held:
        raise _NotServed("refused", f"the server does not hold {checkpoint_id} (it holds {', '.join(held) or 'none yet'})")
    if held[checkpoint_id] != digest:
        raise _NotServed("refused", f"the server's manifest of {checkpoint_id} differs from this one (digest)")


def _check_reply(reply: dict[str, Any], checkpoint_id: str, digest: str, nbytes: int) -> None:
    if reply.get("ok") is not True:
        raise _NotServed("refused", f"the server refused: {reply.get('why', reply)!s:.300}")
    if reply.get("id") != checkpoint_id or reply.get("digest") != digest or reply.get("bytes") != nbytes:
        raise _NotServed("failed", f"the server answered for {reply.get('id')!r}, {reply.get('bytes')!r} bytes, "
                                   f"not {checkpoint_id}, {nbytes} bytes")


def _until_gone(pid: int, *, kill: bool) -> None:
    """Wait until process ``pid`` has exited (killed first when ``kill``): a dead process's
    copies are over. Bounded by :data:`GONE_TIMEOUT_S`."""
    if kill:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return  # gone
        if state in (b"Z", b"X"):
            return  # exited: its files and device context are released
        time.sleep(0.01)
