"""The transport of a live migration: a gpusnap root that the source saves rounds into and
the target restores them from, plus a few small files of the migration's own.

Layout (``ROOT`` is an ordinary checkpoint root: ``gpusnap ls ROOT`` lists the rounds)::

    ROOT/manifests, packs, ...       the rounds: checkpoints tagged ``migrate-000001``, ...,
                                     the last one ``migrate-00000N-handoff``
    ROOT/migrate/source.json         who the source is (pid, host, whether it made ROOT)
    ROOT/migrate/source.lock         flock held by the live source (local roots)
    ROOT/migrate/target.json         the target's claim: the round it is reading, its bell
    ROOT/migrate/target.lock         flock held by the live target (local roots)
    ROOT/migrate/bell-<token>.sock   the target's doorbell (local roots, see bell.py)
    ROOT/migrate/handoff.json        a fast handoff's header, and its bytes file
    ROOT/migrate/handoff-<token>.bin (local roots, see delta_file.py)

A transport the source makes itself (``Source(app_state)`` with no ``to``) is a private
directory (0700) under ``Config.memory_tier_dir`` (``/dev/shm``):
``gpusnap-<uid>/migrate-<random>``; making one first removes those there that nothing can
complete any more (:func:`sweep`). Small files are written to a temporary name in
``migrate/`` and renamed into place, so a reader sees the old or the new one whole.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import time
import weakref
from dataclasses import dataclass
from typing import Any

from gpusnap import fork_safety
from gpusnap.config import Config
from gpusnap.errors import CheckpointError
from gpusnap.storage.backend import Backend, open_backend
from gpusnap.storage.backend_protocol import poll_until
from gpusnap.storage.flock_probe import flock_held as _flock_held, try_flock
from gpusnap.storage.layout import LAYOUT, ROOT_FILE
from gpusnap.storage.private_dir import ensure_private_dir, open_private
from gpusnap.storage.repository import Repository

__all__ = [
    "DELTA_HEADER", "FORMAT", "MIGRATE", "SOURCE_FILE", "SOURCE_LOCK", "TARGET_FILE", "TARGET_LOCK", "Flock", "RoundTag",
    "default_base", "detach_root", "flock_held", "local_path", "make_root", "parse_tag", "pid_namespace",
    "process_alive", "process_start", "read_json", "remove_root", "round_tag", "sweep", "whoami", "write_json",
]

log = logging.getLogger("gpusnap")

MIGRATE = "migrate"
SOURCE_FILE = f"{MIGRATE}/source.json"
SOURCE_LOCK = f"{MIGRATE}/source.lock"
TARGET_FILE = f"{MIGRATE}/target.json"
TARGET_LOCK = f"{MIGRATE}/target.lock"
DELTA_HEADER = f"{MIGRATE}/handoff.json"  # a fast handoff's header (delta_file.py)
FORMAT = "gpusnap-migrate"
_TAG = re.compile(r"^migrate-(\d{6,})(-handoff)?$")


@dataclass(frozen=True)
class RoundTag:
    """A round's place in the migration (``seq``, from 1) and whether it is the handoff."""

    seq: int
    final: bool


def round_tag(seq: int, *, final: bool) -> str:
    """The tag of round ``seq``.

    >>> round_tag(3, final=True)
    'migrate-000003-handoff'
    """
    return f"migrate-{seq:06d}" + ("-handoff" if final else "")


def parse_tag(tag: str | None) -> RoundTag | None:
    """The round a checkpoint's tag names, or None when it is no round of a migration."""
    m = _TAG.match(tag or "")
    return None if m is None else RoundTag(int(m.group(1)), m.group(2) is not None)


def default_base(config: Config) -> str:
    """Where a transport the source makes lives: host memory, as the memory tier's."""
    return config.memory_tier_dir or os.environ.get("GPUSNAP_MEMORY_TIER_DIR") or "/dev/shm"


def make_root(to: str | os.PathLike[str] | None, config: Config) -> tuple[str, bool]:
    """The transport root for ``to`` and whether it was made here (a private directory in
    host memory when ``to`` is None). A given root must be new or empty: rounds of this
    migration are the only checkpoints its target may find there."""
    if to is None:
        base = default_base(config)
        if not os.path.isdir(base):
            raise FileNotFoundError(errno.ENOENT, f"{base} is not a directory (set Config.memory_tier_dir to a "
                                    "tmpfs of yours, or pass to= a root)", base)
        parent = ensure_private_dir(os.path.join(base, f"gpusnap-{os.geteuid()}"),
                                    what="the migration transport's directory",
                                    elsewhere="set Config.memory_tier_dir to a tmpfs of yours, or pass to= a root")
        sweep(parent, config)
        root = os.path.join(parent, f"migrate-{secrets.token_hex(8)}")
        os.mkdir(root, 0o700)
        return root, True
    root = os.fspath(to)
    backend = open_backend(root)
    if backend.exists("") and backend.isdir("") and set(backend.listdir("")) - (LAYOUT - {ROOT_FILE}):
        raise ValueError(f"{root} is not empty: a migration's transport must be a new or empty root (the target "
                         "takes every round it finds there for one of this migration's)")
    if "://" not in root.removeprefix("file://"):
        ensure_private_dir(root.removeprefix("file://"), what="the migration transport")
    return root, False


def sweep(parent: str, config: Config) -> list[str]:
    """Remove the transports in ``parent`` (this user's directory of those sources made) that
    nothing can complete: their source gone (its lock free, which on the tmpfs of
    ``Config.memory_tier_dir`` the kernel guarantees once the process is gone, and its
    process not alive here) before a handoff round committed, and no target reading them
    (its lock free). A handed-off one stays, however late its target comes (its rounds are
    the program's state now), and so does one without ``source.json`` yet (a source making
    it); a transport whose files cannot be read is kept. Also removes what a target that
    died while removing a spent transport left (:func:`detach_root`'s names). Returns the
    roots removed."""
    removed = []
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return removed
    for name in names:
        root = os.path.join(parent, name)
        if name.startswith(_DETACHED):
            try:
                if stat.S_ISDIR(os.lstat(root).st_mode):
                    remove_root(root)
                    removed.append(root)
            except OSError:
                pass
            continue
        try:
            if not name.startswith("migrate-") or not _abandoned(root, config):
                continue
        except (OSError, CheckpointError):
            continue
        log.info("gpusnap: removing %s, the transport of a migration whose source died before its handoff", root)
        remove_root(root)
        removed.append(root)
    return removed


def _abandoned(root: str, config: Config) -> bool:
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        return False
    doc = read_json(open_backend(root), SOURCE_FILE)
    if doc is None or doc.get("format") != FORMAT or not doc.get("made"):
        return False
    # (source.json is written once the source holds its lock: probing it cannot stop a source starting)
    if flock_held(os.path.join(root, SOURCE_LOCK)) or process_alive(doc) or \
            flock_held(os.path.join(root, TARGET_LOCK)):
        return False
    if read_json(open_backend(root), DELTA_HEADER) is not None:  # (a fast handoff: a target can complete it)
        return False
    good, bad = Repository.open(root, config=config).scan()
    return not bad and not any(getattr(parse_tag(m.tag), "final", False) for m in good)


def write_json(backend: Backend, path: str, doc: dict[str, Any]) -> None:
    """``doc`` at ``path``, whole: written to a temporary name beside it, then renamed."""
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    handle = backend.open_write(tmp)
    try:
        handle.write(json.dumps(doc, sort_keys=True).encode())
    finally:
        handle.close(sync=False)  # (a crash loses it with the migration: no fsync needed)
    try:
        backend.rename(tmp, path)
    except BaseException:
        try:
            backend.remove(tmp)
        except OSError:
            pass
        raise


def read_json(backend: Backend, path: str) -> dict[str, Any] | None:
    """The JSON object at ``path``, or None when it is absent or not one."""
    try:
        doc = json.loads(backend.read_range(path).decode())
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def remove_root(root: str) -> None:
    """Remove the transport, every round in it (missing already is fine)."""
    local = root.removeprefix("file://")
    if "://" not in local:
        shutil.rmtree(local, ignore_errors=True)
        return
    backend: Any = open_backend(root)
    try:
        backend.fs.rm(backend._abs(""), recursive=True)
    except FileNotFoundError:
        pass


_DETACHED = ".removing-"


def detach_root(root: str) -> str | None:
    """Rename a local transport out of the way (one instant), so that its path is free at
    once for the next migration and what remains can be removed at leisure; returns the
    name it now has, or None (a URL, or the rename failed: remove it where it is)."""
    local = local_path(root)
    if local is None:
        return None
    gone = os.path.join(os.path.dirname(os.path.abspath(local)), f"{_DETACHED}{secrets.token_hex(8)}")
    try:
        os.rename(local, gone)
    except OSError:
        return None
    return gone


def local_path(root: str) -> str | None:
    """The transport's local directory, or None for a URL (no locks, no bell there)."""
    local = root.removeprefix("file://")
    return None if "://" in local else local


class Flock:
    """An exclusive ``flock`` on a file of a local transport, held until :meth:`release`
    (the kernel drops it when the process dies, SIGKILL included): how each side tells the
    other it is alive.

    A flock lasts while any copy of its descriptor is open, and a child forked without exec
    (a DataLoader worker, a helper) inherits one: the child closes its copy at once, so that
    it does not keep the lock after its parent dies (storage's writer lease does the same)."""

    def __init__(self, path: str, *, timeout: float = 0.0) -> None:
        fd = open_private(path, os.O_RDWR | os.O_CREAT)
        # (the other side's liveness probe (flock_held) takes a free lock for an instant)
        if not poll_until(lambda: try_flock(fd), timeout):
            os.close(fd)
            raise BlockingIOError(errno.EWOULDBLOCK, "held by another process", path)
        self.path = path
        self._fd: int | None = fd
        _held.add(self)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # (closing releases the flock)


_held: weakref.WeakSet[Flock] = weakref.WeakSet()


def _after_fork() -> None:
    for lock in list(_held):
        lock.release()  # (closing the child's copy; LOCK_UN would unlock the parent's too)


fork_safety.at_fork(after_in_child=_after_fork)


def flock_held(path: str) -> bool:
    """Whether a live process holds ``path``'s flock (storage.flock_probe; a link is not followed)."""
    return _flock_held(path, follow_links=False)


def process_alive(doc: dict[str, Any] | None) -> bool | None:
    """Whether the process a ``source.json``/``target.json`` names lives: True/False on this
    host (its pid, and its start time so that a reused pid does not count), None elsewhere
    (another host, or another pid namespace of this one: a container sharing its host name)."""
    if not doc or doc.get("host") != socket.gethostname() or doc.get("pid_ns") != pid_namespace():
        return None
    pid = doc.get("pid")
    if not isinstance(pid, int):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    started = doc.get("pid_start")
    return started is None or started == process_start(pid)


def process_start(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (``/proc/<pid>/stat``), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_namespace() -> str | None:
    """This process's pid namespace (``pid:[4026531836]``), or None where /proc does not say."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def whoami() -> dict[str, Any]:
    """This process, for ``source.json`` / ``target.json``."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "pid_ns": pid_namespace(),
            "pid_start": process_start(os.getpid()), "since": time.time()}
