"""The resident restore server (``gpusnap serve ROOT``): holds a root's newest checkpoints in
page-locked host memory and copies them into a fresh process's device memory over CUDA IPC.

Why: a fresh process's first restore pays set-up (page-locking staging memory, reader
processes, the check's kernels) and reads every byte from files, ~2 s for a 6 GB model
against 0.11 s of host-to-device copying. A resident process pays that once; a
client then pays a connection, one request and the copies (docs/serve.md).

Life cycle (:meth:`Server.start` / :meth:`Server.serve_forever` / :meth:`Server.stop`):

    start():  lock file (one server per root) -> socket bound (a stale one from a killed
              server is replaced), 0600 -> accept thread -> first refresh (loads) -> "ready"
    running:  each connection on its own thread (hello, one request, one reply); a watcher
              refreshes every ``poll_s`` or when a request names a checkpoint not held
    stop():   (any thread, a signal handler) serve_forever() returns through close():
    close():  stop accepting, socket removed, requests in flight finish (bounded), memory freed

>>> server = Server("/dev/shm/run1/ckpt", device="cuda:0")   # doctest: +SKIP
>>> server.start(); server.serve_forever()                      # until stop() or a signal  # doctest: +SKIP
"""

from __future__ import annotations

import fcntl
import logging
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from gpusnap.config import Config
from gpusnap.restore.via_server import paths, protocol
from gpusnap.restore.via_server.connection import peer
from gpusnap.restore.via_server.cuda_ipc import bus_id
from gpusnap.serving.cuda_runtime import Runtime
from gpusnap.serving.holdings import Holdings
from gpusnap.serving.request import BrokenDevice, Fault, serve_restore
from gpusnap.storage.private_dir import open_private

__all__ = ["Server", "ServerRunning", "serve"]

log = logging.getLogger("gpusnap")

REQUEST_TIMEOUT_S = 30.0  # a client that connected but sends no request in this time is dropped
STOP_TIMEOUT_S = 10.0  # stop(): requests still copying after this are abandoned
MAX_CLIENTS = 32  # connections served at once; more are told "busy" (they read files)


class ServerRunning(RuntimeError):
    """Another server already serves this root (its lock file is held)."""


class Server:
    """Serves restores of ``root``'s newest ``keep`` checkpoints; see the module docstring.

    ``device``: the GPU it copies to (``cuda:N``; default ``cuda:0`` when CUDA is present),
    or ``cpu``: it then serves host memory only (clients' CUDA targets land on the host
    first). ``socket``: the path to listen on (default ``paths.socket_path(root)``).
    ``on_event`` gets one dict per event (``ready``, ``held``, ``dropped``, ``failed``,
    ``served``, ``refused``, ``stopped``). ``ops``: more control requests, by op name; each
    gets the request and returns the reply (``{"ok": ...}``), on the connection's thread
    (``gpusnap serve --pool`` answers ``take`` so).
    """

    def __init__(self, root: str | os.PathLike[str], *, keep: int = 1, device: str | torch.device | None = None,
                 socket: str | None = None, poll_s: float = 1.0, config: Config | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None,
                 ops: Mapping[str, Callable[[dict[str, Any]], dict[str, Any]]] | None = None) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer, got {keep!r}")
        if poll_s <= 0:
            raise ValueError(f"poll_s must be positive, got {poll_s!r}")
        self.root = paths.real_root(root)
        self.device = torch.device(device if device is not None else ("cuda:0" if torch.cuda.is_available() else "cpu"))
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"device must be cuda:N or cpu, got {self.device}")
        self.runtime: Runtime | None = None
        self.bus_id: str | None = None
        if self.device.type == "cuda":
            index = self.device.index or 0
            torch.cuda.set_device(index)
            torch.cuda.init()
            self.runtime = Runtime(index)
            self.bus_id = bus_id(index)
        self.socket_path = socket if socket is not None else paths.socket_path(self.root, create=True)
        self.poll_s = poll_s
        self.on_event = on_event or (lambda event: None)
        self.ops = dict(ops or {})
        self.fault = Fault.from_env()
        self.holdings = Holdings(self.root, keep=keep, runtime=self.runtime, config=config, on_event=self._event,
                                 threads=max(2, min(16, os.cpu_count() or 2)))
        self._lock_fd: int | None = None
        self._listener: socket.socket | None = None
        self._inode: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._poke = threading.Event()  # wakes the watcher before its poll
        self._wake_r, self._wake_w = os.pipe()  # wakes the accept loop at stop()
        self._threads: set[threading.Thread] = set()
        self._threads_lock = threading.Lock()
        self._closing = threading.Lock()
        self.broken: str | None = None  # why the server stopped on its own (a CUDA failure)

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Take the root's lock, listen, load the newest checkpoints; returns when ready."""
        self._take_lock()
        try:
            self._listen()
            self._spawn(self._accept_loop, "gpusnap-serve-accept")
            self.holdings.refresh()
            self._spawn(self._watch, "gpusnap-serve-watch")
        except BaseException:
            self.close()
            raise
        self._event({"event": "ready", "root": self.root, "socket": self.socket_path, "pid": os.getpid(),
                     "device": str(self.device), **self.holdings.status()})

    def serve_forever(self) -> None:
        """Until :meth:`stop` (from a signal handler, another thread, or a broken device), then
        :meth:`close`."""
        self._stop.wait()
        self.close()

    def stop(self) -> None:
        """Ask the server to stop; returns at once (safe in a signal handler or any thread)."""
        self._stop.set()
        self._poke.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # (closed: the server is closed)
            pass

    def close(self) -> None:
        """Stop accepting, remove the socket, let requests in flight finish (at most
        :data:`STOP_TIMEOUT_S`), free the memory, release the lock. Idempotent."""
        self.stop()
        with self._closing:
            if self._listener is not None:
                self._remove_socket()
                self._listener.close()
                self._listener = None
            deadline = time.monotonic() + STOP_TIMEOUT_S
            with self._threads_lock:
                threads = [t for t in self._threads if t is not threading.current_thread()]
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            self.holdings.close()
            if self._wake_w >= 0 and all(not t.is_alive() for t in threads):
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # (releases the lock)
                self._lock_fd = None
                self._event({"event": "stopped", "why": self.broken or "asked"})

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take_lock(self) -> None:
        lock = paths.lock_path(self.socket_path)
        fd = open_private(lock, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ServerRunning(f"another gpusnap serve already serves {self.root} (it holds {lock})") from None
        self._lock_fd = fd

    def _listen(self) -> None:
        """Bind the socket, 0600 from the start; a file left there is a dead server's (we hold
        the lock), so it is replaced."""
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            listener.bind(self.socket_path)
        finally:
            os.umask(old)
        listener.listen(64)
        info = os.stat(self.socket_path)
        self._inode = (info.st_dev, info.st_ino)
        self._listener = listener

    def _remove_socket(self) -> None:
        """Unlink the socket, unless it is no longer ours."""
        try:
            info = os.stat(self.socket_path)
            if (info.st_dev, info.st_ino) == self._inode:
                os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> bool:
        with self._threads_lock:
            if len(self._threads) >= MAX_CLIENTS + 2:
                return False
            t = threading.Thread(target=self._run, args=(target, *args), name=name, daemon=True)
            self._threads.add(t)
        t.start()
        return True

    def _run(self, target: Callable[..., None], *args: Any) -> None:
        try:
            target(*args)
        finally:
            with self._threads_lock:
                self._threads.discard(threading.current_thread())

    # -- threads -------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stop.is_set():
            ready, _, _ = select.select([listener, self._wake_r], [], [])
            if self._stop.is_set():
                return
            if listener in ready:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                if not self._spawn(self._serve_connection, "gpusnap-serve-client", conn):
                    self._answer_busy(conn)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._poke.wait(self.poll_s)
            self._poke.clear()
            if self._stop.is_set():
                return
            self.holdings.refresh()

    def _answer_busy(self, conn: socket.socket) -> None:
        with conn:
            try:
                protocol.send_msg(conn, self._hello(held={}, busy=f"serving {MAX_CLIENTS} clients already"))
            except OSError:
                pass

    def _hello(self, **overrides: Any) -> dict[str, Any]:
        return {"v": protocol.VERSION, "pid": os.getpid(), "root": self.root, "device": self.bus_id,
                "held": self.holdings.digests(), **overrides}

    def _serve_connection(self, conn: socket.socket) -> None:
        fds: list[int] = []
        with conn:
            try:
                pid, uid = peer(conn)
                if uid != os.getuid():
                    self._event({"event": "refused", "pid": pid, "why": f"user {uid} is not this server's"})
                    return
                protocol.send_msg(conn, self._hello())
                msg, fds = protocol.recv_msg(conn, time.monotonic() + REQUEST_TIMEOUT_S)
                reply = self._answer(msg if isinstance(msg, dict) else {}, fds, pid)
                protocol.send_msg(conn, reply)
            except (OSError, TimeoutError):
                return  # the client went away: it reads files
            finally:
                for fd in fds:
                    os.close(fd)

    def _answer(self, msg: dict[str, Any], fds: list[int], pid: int) -> dict[str, Any]:
        op = msg.get("op")
        if op == "status":
            return {"ok": True, **self.holdings.status()}
        if op == "missed":  # (a client wanted a checkpoint not held: a newer commit, maybe)
            self._poke.set()
            return {"ok": True}
        if op == "refresh":  # (tests, benchmarks: "hold what is newest now", then answer)
            self.holdings.refresh(retry_failed=True)
            return {"ok": True, **self.holdings.status()}
        handler = self.ops.get(op) if isinstance(op, str) else None
        if handler is not None:
            try:
                return handler(msg)
            except Exception as exc:  # noqa: BLE001 (the client gets why; the server goes on)
                return {"ok": False, "code": "error", "type": type(exc).__name__, "why": str(exc)}
        if op != "restore":
            return {"ok": False, "code": "bad-request", "why": f"unknown op {op!r}"}
        try:
            reply = serve_restore(msg, fds, self.holdings, self.runtime, self.fault)
        except BrokenDevice as exc:  # (its copies are over: the client may fall back at once)
            self.broken = f"a CUDA copy failed ({exc}); restart the server"
            log.error("gpusnap serve: %s", self.broken)
            self.stop()
            reply = {"ok": False, "code": "error", "why": self.broken}
        if reply["ok"]:
            self._event({"event": "served", "pid": pid, "id": reply["id"], "bytes": reply["bytes"],
                         "copy_s": reply["copy_s"]})
        else:
            if reply["code"] == "not-held":
                self._poke.set()  # a newer checkpoint may have been committed: look now
            self._event({"event": "refused", "pid": pid, "why": reply["why"]})
        return reply

    def _event(self, event: dict[str, Any]) -> None:
        try:
            self.on_event(event)
        except Exception:  # noqa: BLE001 (a broken printer must not stop the server)
            log.exception("gpusnap serve: on_event failed")


def serve(root: str | os.PathLike[str], *, keep: int = 1, device: str | torch.device | None = None,
          socket: str | None = None, poll_s: float = 1.0, config: Config | None = None,
          on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Run a :class:`Server` for ``root`` until SIGTERM or SIGINT (on the main thread);
    ``gpusnap serve ROOT`` calls this. Raises :class:`ServerRunning` if another server serves
    ``root``, ``RuntimeError`` if a CUDA copy failed (the server stops: restart it).

    >>> gpusnap.serve("/dev/shm/run1/ckpt", keep=2, on_event=print)   # doctest: +SKIP
    """
    server = Server(root, keep=keep, device=device, socket=socket, poll_s=poll_s, config=config, on_event=on_event)
    previous = {s: signal.signal(s, lambda *_: server.stop()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.start()
        server.serve_forever()
    finally:
        server.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if server.broken is not None:
        raise RuntimeError(f"gpusnap serve stopped: {server.broken}")
