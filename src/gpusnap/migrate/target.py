"""The new process's side of a live migration (:class:`Target`).

Call order: ``Target(address)`` -> ``receive(app_state)`` (returns when the handoff round
is in place; ``lazy=True``: once it is planned, its bytes loading behind the lazy gate) ->
the program resumes -> ``close()`` (``wait()`` first when lazy).

``receive`` applies rounds while the source still runs, so that at the handoff only the
last delta moves. Its loop:

1. List the transport's rounds (checkpoints tagged ``migrate-NNNNNN[-handoff]``). If one is
   newer than the round applied, *claim* it (``migrate/target.json``: ``reading``), then
   list again: if it is still the newest, the source will not delete it (it deletes only
   rounds that are neither its newest nor claimed when it looks, source.py); else claim the
   newer one.
2. Restore it into ``app_state`` through ``restore.delta``: the first round whole, every
   later one as the chunks whose names differ from the round applied before, written into
   the tensors that already hold the rest (``Restorer.restore(replan=...)``). Plain values
   (step counters, RNG state) and ``load_state_dict`` come with every round, the final
   round's last.
3. If it was the handoff round, done: return, the transport removed on a thread behind.
   Else wait for the bell (a ring per committed round, bell.py) or ``poll_s``, whichever
   comes first, and go to 1. While waiting, a source that is gone (its flock on a local
   transport released, or its process gone on this host) before any handoff round appeared
   fails the receive; so does ``timeout`` seconds without a new round.

Failures: a source killed at any moment leaves its uncommitted round invisible (atomic
commits), so the target either finds the handoff or fails with a :class:`MigrationError`
saying what ``app_state`` holds: untouched (no round applied), or one complete, consistent
round of the source's state (older than its last: do not resume from it), or, when the
transport broke while a round was being written into it (a chunk unreadable or corrupt,
pipelined restores only), partly written. It never returns with a mixture. A target that
dies leaves the source running; the next ``Target`` claims the transport and starts over.

``lazy=True`` returns only once the handoff round is known (before it, every byte may still
change, and the program must not run beside its source), with plain values and RNG state in
place and the final delta loading; ops wait for the tensors it writes (docs/restore.md's
lazy gate). It gains the copy of the last delta, not the wait for the handoff.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable, MutableMapping
from dataclasses import replace
from typing import Any, NoReturn

import torch

from gpusnap.config import Config
from gpusnap.errors import CheckpointError, CheckpointNotFoundError, RestoreMismatchError
from gpusnap.handles import RestoreHandle
from gpusnap.migrate import transport
from gpusnap.migrate.bell import Bell
from gpusnap.migrate.delta_apply import DeltaApply
from gpusnap.migrate.delta_file import DELTA_HEADER, DeltaHeader, buffer_name, is_buffer_name
from gpusnap.migrate.delta_premap import Premap
from gpusnap.migrate.errors import MigrationError
from gpusnap.migrate.results import AppliedRound, ReceiveInfo
from gpusnap.migrate.source import Source
from gpusnap.restore.delta import Baseline, Delta
from gpusnap.restore.restorer import AUTO_UPFRONT_BYTES, Restorer, Verify
from gpusnap.storage.backend import open_backend
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.repository import Repository

log = logging.getLogger("gpusnap")

__all__ = ["Target"]

POLL_LOCAL_S = 0.5  # a wait for the bell on a local transport (a ring ends it sooner)
POLL_REMOTE_S = 0.2  # a URL transport has no bell: how often it is listed
LOCK_WAIT_S = 1.0  # the target lock, busy: another target, or the source probing it for an instant


class Target:
    """Receives a running program's state from a :class:`~gpusnap.migrate.Source`.

    ``source``: the source's :attr:`~gpusnap.migrate.Source.address` (or, in one process,
    the Source). ``verify``: how each round's chunks are checked (``Checkpointer.restore``'s;
    ``"auto"``: before any byte of the round is written for deltas up to 256 MiB, else
    pipelined). ``poll_s``: the longest wait for news of the source (None: 0.5 s with a
    bell, 0.2 s without). ``timeout``: fail after this many seconds without a new round
    (None: wait while the source lives). ``on_round(applied)`` is called after each round.

    >>> dst = gpusnap.migrate.Target(address)        # doctest: +SKIP
    >>> info = dst.receive(app_state)                 # when the state is in place  # doctest: +SKIP
    >>> info.rounds[-1].bytes_moved                   # the last delta  # doctest: +SKIP
    """

    def __init__(self, source: str | os.PathLike[str] | Source, *, config: Config | None = None,
                 verify: Verify = "auto", poll_s: float | None = None, timeout: float | None = None,
                 allow_pickle: bool = False, on_round: Callable[[AppliedRound], None] | None = None) -> None:
        root = source.address if isinstance(source, Source) else os.fspath(source)
        if verify not in ("auto", "upfront", "stream", "off"):
            raise ValueError(f"verify must be 'auto', 'upfront', 'stream' or 'off', got {verify!r}")
        for name, value in (("poll_s", poll_s), ("timeout", timeout)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
        self.config = config = config if config is not None else Config.from_env()
        self.address = root
        self.verify = verify
        self.timeout = timeout
        self.allow_pickle = allow_pickle
        self.on_round = on_round
        self._local = transport.local_path(root)
        try:
            self._repo = Repository.open(root, config=config)
        except CheckpointNotFoundError:
            raise MigrationError(f"no migration at {root}: no transport there (gone after a receive, or the source "
                                 "called it off)") from None
        self._lock: transport.Flock | None = None
        self._bell: Bell | None = None
        self._token = secrets.token_hex(8)
        self._piecewise = False  # the rounds applied land in targets a fast handoff can write
        self._whole: tuple[int, ...] = ()  # spans laid out afresh at each round here
        self._applied_id: str | None = None  # the round the two above describe
        self._premap: Premap | None = None  # the source's bytes file, mapped ahead of the handoff
        self._premap_round: str | None = None  # the newest round applied when it was made
        try:  # (a step that fails lets go of what the ones before took: the lock, the bell, the repo)
            self._backend = open_backend(root)
            doc = transport.read_json(self._backend, transport.SOURCE_FILE)
            if doc is None or doc.get("format") != transport.FORMAT:
                raise MigrationError(f"{root} is a checkpoint root, not a live migration's transport (no "
                                     f"{transport.SOURCE_FILE}): pass the address Source.address gives")
            self._source = doc
            if self._local is not None:
                try:
                    self._lock = transport.Flock(os.path.join(self._local, transport.TARGET_LOCK),
                                                 timeout=LOCK_WAIT_S)
                except BlockingIOError:
                    other = transport.read_json(self._backend, transport.TARGET_FILE) or {}
                    raise MigrationError(f"another target (pid {other.get('pid', '?')}) is receiving from {root}: "
                                         "one target at a time") from None
                try:
                    self._bell = Bell(os.path.join(self._local, transport.MIGRATE, f"bell-{self._token}.sock"))
                except OSError:
                    self._bell = None  # (polls instead)
            self._claim(None)
        except BaseException:
            self._release()
            self._repo.close()
            raise
        self.poll_s = poll_s if poll_s is not None else (POLL_LOCAL_S if self._bell is not None else POLL_REMOTE_S)
        self._restorer = Restorer(
            io_threads=config.io_threads, staging_bytes=config.staging_bytes, piece_bytes=config.restore_piece_bytes,
            verify_on_device={"auto": None, "on": True, "off": False}[config.restore_verify_on_device],
            scratch_slots=config.restore_scratch_slots, device_check_min_bytes=config.device_check_min_bytes,
            reader_processes=config.restore_reader_processes, direct_copies=config.restore_direct_copies,
            from_server="off", pinned_upfront=True)  # (a round's delta, again and again)
        self._final: RestoreHandle | None = None  # a lazy handoff still loading
        self._received = False
        self._closed = False
        self._removal: threading.Thread | None = None  # the spent transport going, after a receive
        self._receiving = threading.Lock()

    # -- receive ------------------------------------------------------------------------------
    def receive(self, app_state: MutableMapping[str, Any], *, lazy: bool = False) -> ReceiveInfo:
        """Put the source's state into ``app_state`` (in place, as ``Checkpointer.restore``:
        same tensors, Stateful values' ``load_state_dict``, plain values replaced), applying
        rounds as they come; returns once the handoff round is in place (``lazy=True``:
        once it is planned; then :meth:`wait`). Raises :class:`MigrationError` saying what
        ``app_state`` holds if the source dies first, or ``timeout`` passes."""
        if not isinstance(app_state, MutableMapping):
            raise TypeError(f"app_state must be a mutable mapping (a dict), got {type(app_state).__name__}")
        if not self._receiving.acquire(blocking=False):
            raise MigrationError("receive() is already running on another thread")
        try:
            if self._closed or self._received:
                raise MigrationError("this Target has received already (or is closed): make a new one")
            return self._receive(app_state, lazy)
        except BaseException:
            self._close_premap()  # (a failure or an interrupt: no memory held for a handoff)
            raise
        finally:
            self._receiving.release()

    def _receive(self, app_state: MutableMapping[str, Any], lazy: bool) -> ReceiveInfo:
        started = time.perf_counter()
        last_news = time.monotonic()
        baseline = Baseline()
        applied: Manifest | None = None
        rounds: list[AppliedRound] = []
        while True:
            try:
                newest = self._claim_newest(applied)
            except _Broken as exc:
                self._fail(str(exc), applied, None)
            if newest is None and applied is not None:
                header = self._delta_header(applied)
                if header is not None:
                    return self._apply_delta(header, applied, baseline, app_state, rounds, started)
            if newest is None:
                if not self._source_alive():
                    try:
                        newest = self._claim_newest(applied)  # (it may have handed off and left meanwhile)
                    except _Broken as exc:
                        self._fail(str(exc), applied, None)
                    if newest is None:
                        self._fail(f"the source (pid {self._source.get('pid', '?')} on "
                                   f"{self._source.get('host', '?')}) ended before handing off", applied, None)
                else:
                    if self.timeout is not None and time.monotonic() - last_news > self.timeout:
                        self._fail(f"no new round from the source for {self.timeout} s", applied, None)
                    self._map_ahead()
                    self._wait()
                    continue
            assert newest is not None
            last_news = time.monotonic()
            final = _tag(newest).final
            found = time.perf_counter()
            delta = Delta(baseline)
            try:
                handle = self._restorer.restore(
                    self._repo, newest, app_state, allow_pickle=self.allow_pickle, lazy=lazy and final,
                    verify=self.verify, started=found, replan=delta.replan)
            except RestoreMismatchError as exc:  # (every check runs before a byte is written)
                self._fail(f"app_state does not fit the source's state: {exc}", applied, None, cause=exc)
            except (CheckpointError, OSError) as exc:
                self._fail(f"round {_tag(newest).seq} ({newest.id}) could not be applied: {exc}", applied,
                           self._written(delta, lazy and final), cause=exc)
            if not (lazy and final):
                # a fast handoff can land once a round applied over another has shown which
                # spans this side lays out afresh each time: those the source sends whole
                self._piecewise = self._local is not None and not baseline.empty and delta.writable_piecewise()
                self._whole = delta.relaid_out
                self._applied_id = newest.id
                baseline = delta.applied()
            done = time.perf_counter()
            s = delta.stats
            round_ = AppliedRound(newest.id, _tag(newest).seq, final, s.nbytes, s.bytes_moved, s.chunks_moved,
                                  s.full, done - found)
            rounds.append(round_)
            applied = newest
            self._claim(None)
            if self.on_round is not None:
                self.on_round(round_)
            if final:
                self._received = True
                info = ReceiveInfo(newest.id, tuple(rounds), done - found, done - started - sum(
                    r.apply_s for r in rounds), lazy)
                if lazy:
                    self._final = handle
                else:
                    self._finish()
                return info

    def _delta_header(self, applied: Manifest) -> DeltaHeader | None:
        """The fast handoff's header, when the source wrote one (based on ``applied``, the
        newest round: anything else cannot be completed)."""
        if self._local is None:
            return None
        doc = transport.read_json(self._backend, DELTA_HEADER)
        if doc is None:
            return None
        try:
            header = DeltaHeader.from_doc(doc)
        except CheckpointError as exc:
            self._fail(str(exc), applied, False, cause=exc)
        if header.base != applied.id:
            # a round committed after this target last listed them, the delta based on it:
            # apply that round first (the next listing finds it)
            if any(m.id == header.base and _tag(m).seq > _tag(applied).seq for m in self._safe_rounds()):
                return None
            self._fail(f"the handoff is a delta on round {header.base}, which is not in the transport (the "
                       f"newest is {applied.id})", applied, False)
        return header

    def _apply_delta(self, header: DeltaHeader, applied: Manifest, baseline: Baseline,
                     app_state: MutableMapping[str, Any], rounds: list[AppliedRound], started: float) -> ReceiveInfo:
        """Put a fast handoff's delta in place (delta_apply.py) and end the receive."""
        found = time.perf_counter()
        assert self._local is not None
        whole = frozenset(r.span for r in header.runs if r.start == 0 and r.stop == header.spans[r.span])
        apply = DeltaApply(header, os.path.join(self._local, transport.MIGRATE, header.data),
                           Delta(baseline, supplied=whole),
                           premapped=None if self._premap is None else self._premap.view_for(header.data, header.nbytes))
        manifest = replace(applied, tree=header.tree, tag=transport.round_tag(header.seq, final=True))
        try:
            self._restorer.restore(self._repo, manifest, app_state, allow_pickle=self.allow_pickle, lazy=False,
                                   verify="off", started=found, replan=apply.replan)
        except RestoreMismatchError as exc:
            self._fail(f"app_state does not fit the source's state: {exc}", applied, None, cause=exc)
        except (CheckpointError, OSError) as exc:
            self._fail(f"the handoff delta on round {applied.id} could not be applied: {exc}", applied,
                       apply.written, cause=exc)
        done = time.perf_counter()
        round_ = AppliedRound(applied.id, header.seq, True, sum(header.spans), apply.bytes_moved, apply.chunks_moved,
                              False, done - found, fast=True)
        rounds.append(round_)
        if self.on_round is not None:
            self.on_round(round_)
        self._received = True
        info = ReceiveInfo(applied.id, tuple(rounds), done - found,
                           done - started - sum(r.apply_s for r in rounds), False)
        self._finish()
        return info

    def wait(self, timeout: float | None = None) -> None:
        """After ``receive(lazy=True)``: until the last delta is in place (raises its
        error); then the transport is removed. Immediate after an eager receive."""
        handle = self._final
        if handle is not None:
            handle.wait(timeout)
            self._final = None
        if self._received:
            self._finish()

    def close(self) -> None:
        """Let go of the transport: after a receive it is removed (a lazy one is waited for
        first); before one, this target stops claiming it (another may receive)."""
        if self._closed:
            return
        try:
            if self._final is not None:
                self.wait()
        finally:
            self._closed = True
            self._release()
            self._restorer.close()
            self._repo.close()
            if self._removal is not None:
                self._removal.join()

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Target({self.address!r})"

    # -- rounds -------------------------------------------------------------------------------
    def _rounds(self) -> list[Manifest]:
        """The transport's committed rounds, oldest first."""
        try:
            good, bad = self._repo.scan()
        except CheckpointError as exc:
            raise _Broken(f"listing the rounds failed: {exc}") from exc
        if bad:
            raise _Broken(f"round {bad[-1].id} cannot be read: {bad[-1].reason}")
        return sorted((m for m in good if _tag(m, strict=False) is not None), key=lambda m: _tag(m).seq)

    def _claim_newest(self, applied: Manifest | None) -> Manifest | None:
        """The newest round, claimed, if it is newer than ``applied`` (see the module docstring)."""
        while True:
            rounds = self._rounds()
            if not rounds or (applied is not None and _tag(rounds[-1]).seq <= _tag(applied).seq):
                return None
            chosen = rounds[-1]
            self._claim(chosen.id)
            again = self._rounds()
            if again and again[-1].id == chosen.id:
                return chosen

    def _claim(self, reading: str | None) -> None:
        transport.write_json(self._backend, transport.TARGET_FILE, {
            "token": self._token, "reading": reading, "bell": None if self._bell is None else os.path.basename(
                self._bell.path), "fast": self._piecewise, "whole": list(self._whole), "applied": self._applied_id, **transport.whoami()})

    def _map_ahead(self) -> None:
        """Between rounds, once a fast handoff can land here: map the source's bytes file
        (delta_premap.py); again after a round if it was not there yet."""
        if not self._piecewise or self._local is None:
            self._close_premap()  # (no fast handoff can land now: no memory held for one)
            return
        if self._premap is not None:
            if not self._premap.empty or self._premap_round == self._applied_id:
                return  # (mapped, being mapped, refused: then read the plain way; or no round since)
            self._close_premap()
        name = buffer_name(str(self._source.get("token", "")))
        path = os.path.join(self._local, transport.MIGRATE, name)
        if not is_buffer_name(name) or not os.path.isfile(path):
            return
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_initialized() else None
        self._premap = Premap(path, device)
        self._premap_round = self._applied_id
        weakref.finalize(self, self._premap.close)  # (a Target dropped without close(): its pages unlocked)

    def _close_premap(self) -> None:
        premap, self._premap = self._premap, None
        if premap is not None:
            premap.close()

    def _wait(self) -> None:
        if self._bell is not None:
            self._bell.wait(self.poll_s)
        else:
            time.sleep(self.poll_s)

    def _source_alive(self) -> bool:
        # the flock alone is not enough: a process the source forked where no at-fork hook runs
        # (a fork in C, transport.Flock) holds it as long as it lives, after the source is gone
        if transport.process_alive(self._source) is False:
            return False
        if self._local is not None:
            return transport.flock_held(os.path.join(self._local, transport.SOURCE_LOCK))
        return True

    # -- endings ------------------------------------------------------------------------------
    def _written(self, delta: Delta, lazy: bool) -> bool:
        """Whether a round that failed may have written some of its bytes: a pipelined
        restore writes each piece once checked; an upfront one nothing before all are."""
        if delta.stats.spans == 0:  # (it failed before its plan: nothing written)
            return False
        if self.verify == "upfront":
            return False
        if self.verify == "auto":
            return lazy or delta.stats.bytes_moved > AUTO_UPFRONT_BYTES
        return True

    def _fail(self, why: str, applied: Manifest | None, written: bool | None, *,
              cause: BaseException | None = None) -> NoReturn:
        if written:
            holds = ("is partly written (a round failed while its bytes were being written): receive again "
                     "with a new Target before using it")
        elif applied is None:
            holds = "is untouched"
        else:
            holds = (f"holds round {_tag(applied).seq} ({applied.id}) of the source's state, complete and "
                     "consistent, but not its last: do not resume from it")
        gone = self._source_alive() is False and not any(_tag(m).final for m in self._safe_rounds()) and (
            self._local is None or transport.read_json(self._backend, DELTA_HEADER) is None)
        self._release()
        if gone and self._source.get("made"):  # (nothing can complete this migration: free the host memory)
            transport.remove_root(self.address)
        raise MigrationError(f"receiving from {self.address} failed: {why}; app_state {holds}") from cause

    def _safe_rounds(self) -> list[Manifest]:
        try:
            return self._rounds()
        except _Broken:
            return []

    def _finish(self) -> None:
        """Received: the transport is spent; remove it. A local one is renamed out of the
        way first (its path free at once for the next migration), then removed on a thread
        of its own, so that ``receive()`` returns without waiting (freeing a state's worth of
        host memory would be downtime); not a daemon thread, so the interpreter waits for it
        at exit, and ``close()`` does too. The bytes file's map goes on that thread too
        (unlocking pages takes time)."""
        premap, self._premap = self._premap, None
        self._release()
        detached = None if self._removal is not None else transport.detach_root(self.address)
        if detached is None:
            if premap is not None:
                premap.close()
            if self._removal is None:  # (a URL, or it could not be renamed: removed here, as it was)
                transport.remove_root(self.address)
            return
        removal = threading.Thread(target=_remove, args=(detached, self.address, premap),
                                   name="gpusnap-migrate-remove")
        removal.start()
        self._removal = removal

    def _release(self) -> None:
        self._close_premap()
        if self._bell is not None:
            self._bell.close()
            self._bell = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def _remove(path: str, address: str, premap: Premap | None) -> None:
    try:
        if premap is not None:
            premap.close()
        transport.remove_root(path)
    except Exception as exc:  # noqa: BLE001  (a thread's error would only reach stderr)
        log.warning("gpusnap: the spent transport of %s could not be removed from %s: %s", address, path, exc)


class _Broken(Exception):
    """The transport cannot be read (removed, unreadable): the receive fails saying why."""


def _tag(manifest: Manifest, *, strict: bool = True) -> Any:
    tag = transport.parse_tag(manifest.tag)
    if tag is None and strict:
        raise MigrationError(f"checkpoint {manifest.id} is no round of a migration")
    return tag

