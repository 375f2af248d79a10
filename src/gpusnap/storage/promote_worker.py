"""The promotion helper's own side: ``storage/promote_process.py`` says why, and the protocol.

Run by the program as ``python -I -c`` with a few lines that read the program's ``sys.path``
from the pipe end ``R`` (its first message), then call ``main(R, W)``: the channel is on the
two pipe ends. One thread reads the program's messages (a job, a cancel, the answer to
"commit?", the end of input); the main thread runs one promotion at a time. Its tiers stay
open between jobs, so each slab is mapped and page-locked here once.
"""

from __future__ import annotations

import errno
import os
import queue
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from gpusnap.config import Config
from gpusnap.errors import CheckpointError, StorageError
from gpusnap.storage.backend import LocalBackend
from gpusnap.storage.fast_tier import FastTier
from gpusnap.storage.promote import CancelToken, PromotionCancelled, promote
from gpusnap.storage.promote_process import cpu_seconds, package_dir, read_message, write_message
from gpusnap.storage.repository import Repository
from gpusnap.thread_priority import LOWEST

__all__ = ["main"]


def main(channel_in: int, channel_out: int) -> None:
    """Serve the program on the pipe ends ``channel_in`` and ``channel_out``."""
    os.dup2(2, 1)  # (whatever anything prints goes to stderr)
    for sig in (signal.SIGINT, signal.SIGTERM):
        # the program decides when this ends (end of its input; a SIGTERM'd program finishes
        # its promotions first, Config.sigterm_grace_s): a job's group signalled at once
        # would otherwise lose the promotion in flight
        signal.signal(sig, signal.SIG_IGN)
    try:  # (before any thread starts: they inherit it) the program's threads go first
        os.setpriority(os.PRIO_PROCESS, 0, LOWEST)
    except OSError:
        pass
    try:
        _hello, fields, device = read_message(channel_in)
        config = Config(**fields)
        if device is not None:
            import torch

            if torch.cuda.is_available():  # the checks hash on this device (hash_device: CUDA up)
                torch.cuda.set_device(torch.device(device))
                torch.cuda.init()
    except EOFError:
        return
    except BaseException as exc:
        write_message(channel_out, ("failed", f"{type(exc).__name__}: {exc}"))
        return
    write_message(channel_out, ("ready", cpu_seconds(), package_dir()))
    _Helper(channel_in, channel_out, config).run()


class _ProgramsToken(CancelToken):
    """A promotion's token here: cancelled by the program's message (or its end), and the
    commit asks the program first, which holds its own token meanwhile."""

    def __init__(self, job: int, send: Callable[[Any], None]) -> None:
        super().__init__()
        self.job = job
        self._send = send
        self._answers: queue.Queue[str] = queue.Queue()

    def answer(self, word: str) -> None:
        self._answers.put(word)

    @contextmanager
    def committing(self, checkpoint_id: str) -> Iterator[None]:
        self.check(checkpoint_id)
        self._send(("commit?", self.job))
        if self._answers.get() != "go":
            self.cancelled = True
            raise PromotionCancelled(f"the promotion of {checkpoint_id} was called off: nothing was committed")
        yield


class _ProgramsLease:
    """The writer lease of the durable root, held by the program for as long as this helper
    works for it; lost once the program is gone (this process is then someone else's child)."""

    def __init__(self) -> None:
        self._program = os.getppid()

    def confirm(self) -> None:
        if os.getppid() != self._program:
            raise OSError(errno.ESRCH, "the program whose writer lease this helper wrote under is gone")

    def release(self) -> None:
        return


class _OnBehalfBackend(LocalBackend):
    """The program's durable root, written on the program's behalf (under its lease)."""

    def writer_lease(self, owner: dict[str, Any], timeout: float) -> _ProgramsLease:  # type: ignore[override]
        return _ProgramsLease()


class _Helper:
    def __init__(self, channel_in: int, channel_out: int, config: Config) -> None:
        self._in, self._out, self._config = channel_in, channel_out, config
        self._jobs: queue.Queue[tuple[dict[str, Any], _ProgramsToken] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._token: _ProgramsToken | None = None  # the newest job's
        self._tiers: dict[str, FastTier] = {}
        self._roots: dict[str, Repository] = {}
        self._pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="gpusnap-promote")

    def _send(self, message: Any) -> None:
        write_message(self._out, message)

    def run(self) -> None:
        threading.Thread(target=self._read, name="gpusnap-promote-channel", daemon=True).start()
        try:
            while (item := self._jobs.get()) is not None:
                job, token = item
                reply = self._promote(job, token)
                try:
                    self._send(reply)
                except OSError:
                    break
        finally:
            self._pool.shutdown(wait=True)
            for repo in [*self._tiers.values(), *self._roots.values()]:
                repo.close()

    def _read(self) -> None:
        try:
            while True:
                message = read_message(self._in)
                kind = message[0]
                if kind == "job":  # (its token made here: a cancel right behind it finds it)
                    token = _ProgramsToken(message[1]["job"], self._send)
                    with self._lock:
                        self._token = token
                    self._jobs.put((message[1], token))
                    continue
                with self._lock:
                    token = self._token
                if token is None or message[1] != token.job:  # (a late word about a job that ended)
                    continue
                if kind == "cancel":
                    token.cancel()
                elif kind in ("go", "no"):
                    token.answer(kind)
        except (EOFError, OSError, ValueError, TypeError, IndexError, KeyError):
            # the program is gone, closed us or sent nonsense: commit nothing, end
            with self._lock:
                token = self._token
            if token is not None:
                token.cancel()
                token.answer("no")
            self._jobs.put(None)

    def _promote(self, job: dict[str, Any], token: _ProgramsToken) -> tuple[Any, ...]:
        try:
            fast = self._tier(job["fast_root"], job["fast_identity"])
            durable = self._durable(job["durable_root"])
            manifest = fast.load_manifest(job["id"])
            promote(fast, manifest, durable, self._pool, extra_stats=job["extra_stats"], cancel=token,
                    workers=job["workers"])
            return ("done", token.job, cpu_seconds())
        except BaseException as exc:  # (a SystemExit from a backend too: the program decides)
            return ("error", token.job, type(exc).__name__, str(exc), cpu_seconds(), isinstance(exc, CheckpointError))

    def _tier(self, path: str, identity: Any) -> FastTier:
        want = tuple(identity) if identity is not None else None
        tier = self._tiers.get(path)
        if tier is not None and tier.identity != want:
            tier.close()
            del self._tiers[path]
            tier = None
        if tier is None:
            tier = FastTier.open(path, config=self._config)
            if tier.identity != want:  # (removed and made again since the program opened it)
                tier.close()
                raise StorageError(f"the fast tier {path} was removed: the program's checkpoint is no longer there")
            self._tiers[path] = tier
        return tier

    def _durable(self, path: str) -> Repository:
        repo = self._roots.get(path)
        if repo is None:
            repo = self._roots[path] = Repository.open(path, config=self._config, backend=_OnBehalfBackend(path))
        return repo
