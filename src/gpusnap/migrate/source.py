"""The running program's side of a live migration (:class:`Source`).

Call order: ``Source(app_state, to)`` -> ``precopy()`` between steps, any number of times,
while the program runs -> ``handoff()`` at a step or request boundary -> the program stops
using ``app_state`` (the target owns it now) -> ``close()``.

Each ``precopy()`` is a concurrent save of ``app_state`` into the transport root (a
``Checkpointer`` of its own, written directly, no memory tier): it returns in milliseconds
and the copy runs while the program goes on. Chunks unchanged since the round before are
neither copied nor written again (incremental saves, by the device hashes), so once the
first round has moved the whole state, rounds move only what changed. One round is in
flight at a time: a ``precopy()`` while one is still being written starts nothing and
returns None. ``handoff()`` waits for the round in flight, then moves the last delta: that
is the program's whole share of the downtime. On a local transport it is a *fast handoff*
where it can be exact: ``precopy()`` took per-chunk digests of the state just before its
round's save (state_digests.py); ``handoff()`` takes them again, copies the chunks that
differ into a file prepared at the first round and commits their header (delta_file.py,
delta_write.py; the target's side is delta_apply.py). Otherwise (``general_why`` says why)
it saves once more, synchronously (``blocking=True``), a round tagged as the handoff, which
is how the target knows it is final.

Between rounds, the source keeps the newest round and the one the target says it is
reading (``migrate/target.json``) and deletes the others; a committed round rings the
target's bell (bell.py). Nothing here waits for the target: a target that dies leaves
the source running, and a new ``Target`` can take over from any round (see target.py).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
import weakref
from collections.abc import MutableMapping
from dataclasses import replace
from typing import Any

from gpusnap.checkpointer import Checkpointer
from gpusnap.config import MiB, Config
from gpusnap.errors import CheckpointError
from gpusnap.handles import PendingSave
from gpusnap.migrate import transport
from gpusnap.migrate.bell import ring
from gpusnap.migrate.delta_file import DELTA_HEADER, DeltaBuffer, buffer_name, capacity_for
from gpusnap.migrate.delta_write import delta_bytes, write_delta
from gpusnap.migrate.errors import MigrationError
from gpusnap.migrate.results import HandoffInfo, RoundInfo
from gpusnap.migrate.state_digests import Digests, changed_runs, take, with_whole_spans
from gpusnap.state.flat import FlatPlan, FlatState
from gpusnap.state.flatten import flatten
from gpusnap.storage.backend import open_backend
from gpusnap.storage.repository import Repository

__all__ = ["CHUNK_SIZE", "Source"]

log = logging.getLogger("gpusnap")

# A migration's default chunk: the unit a round moves when any byte of it changed. Smaller
# than a checkpoint's 4 MiB so that a generating model's KV cache, written a token at a
# time, dirties less per round; a 7 GB state is then ~7000 chunks, a manifest read in ms.
CHUNK_SIZE = 1 * MiB


class Source:
    """The state of a running program, moving to a :class:`~gpusnap.migrate.Target`.

    ``to``: where the rounds go: None (a private directory in host memory, for a target on
    this machine; :attr:`address` names it), or a new or empty checkpoint root (a local
    directory, or any fsspec URL gpusnap can write: a target elsewhere reads it there).
    ``config``: the transport's Checkpointer knobs (its memory tier is always off: the
    rounds are written to the transport directly; the chunk size defaults to
    :data:`CHUNK_SIZE`).

    >>> src = gpusnap.migrate.Source(app_state)         # doctest: +SKIP
    >>> start_target(src.address)                        # doctest: +SKIP
    >>> for batch in batches:                            # doctest: +SKIP
    ...     train_step(batch); src.precopy()             # rounds while the program runs
    >>> info = src.handoff()                             # doctest: +SKIP
    >>> info.round.bytes_moved < info.round.bytes_total  # doctest: +SKIP
    True
    """

    def __init__(self, app_state: MutableMapping[str, Any], to: str | os.PathLike[str] | None = None, *,
                 config: Config | None = None, allow_pickle: bool = False, fast_handoff: bool = True) -> None:
        if not isinstance(app_state, MutableMapping):
            raise TypeError(f"app_state must be a mutable mapping (a dict), got {type(app_state).__name__}")
        if not isinstance(fast_handoff, bool):
            raise TypeError(f"fast_handoff must be a bool, got {type(fast_handoff).__name__}")
        if config is None:
            config = Config.from_env() if os.environ.get("GPUSNAP_CHUNK_SIZE") else Config.from_env(
                chunk_size=CHUNK_SIZE)
        elif not isinstance(config, Config):
            raise TypeError(f"config must be a gpusnap.Config, got {type(config).__name__}")
        self.config = config = replace(config, memory_tier="off")
        self.app_state = app_state
        root, self._made = transport.make_root(to, config)
        self.address: str = root
        """What the target needs: ``gpusnap.migrate.Target(address)``."""
        self._left = _Leftovers(root if self._made else None)
        try:
            Repository.open(root, create=True, config=config).close()  # (the target may open it at once)
            self._backend = open_backend(root)
            self._backend.makedirs(transport.MIGRATE)
            local = transport.local_path(root)
            if local is not None:
                self._left.lock = transport.Flock(os.path.join(local, transport.SOURCE_LOCK))
            self._token = secrets.token_hex(8)
            transport.write_json(self._backend, transport.SOURCE_FILE, {
                "format": transport.FORMAT, "version": 1, "token": self._token, "made": self._made,
                **transport.whoami()})
            self._ckpt = Checkpointer(root, keep_last=None, config=config, allow_pickle=allow_pickle)
        except BaseException:
            self._left.clean(handed_off=False)
            raise
        # a Source dropped without close(): its lock goes, and a transport it made goes unless
        # it handed off (a target may still need the rounds); at exit too
        weakref.finalize(self, self._left.clean, handed_off=None)
        self._seq = 0
        self._inflight: PendingSave | None = None
        self._inflight_seq = 0
        self._committed: list[str] = []  # round ids still in the transport, oldest first
        self._rounds: list[RoundInfo] = []
        self._state = "running"  # -> "handed off" | "closed"
        self._why_general: str | None = None
        # the fast handoff (module docstring): the digests of the round in flight, of the
        # newest committed one (its id), and the bytes file the delta goes to (local transports)
        self._allow_pickle = allow_pickle
        self._fast = fast_handoff and transport.local_path(root) is not None
        self._fast_asked = fast_handoff
        self._plan: FlatPlan | None = None
        self._buffer: DeltaBuffer | None = None
        self._inflight_digests: Digests | None = None
        self._base: tuple[str, Digests] | None = None
        self._no_buffer: str | None = None

    # -- the rounds -------------------------------------------------------------------------
    def precopy(self, *, wait: bool = False) -> PendingSave | None:
        """Start a round: a concurrent save of the changed bytes, while the program runs.

        Returns its :class:`~gpusnap.PendingSave`, or None when the round before is still
        being written (rounds never queue up). ``wait=True`` waits for that one first, and
        returns once the new round is committed and the target told. A round that failed
        is raised (once) by the next call, as a :class:`MigrationError`; the source stays
        usable (the next round carries everything the failed one would have).
        """
        self._check_running("precopy()")
        if wait and self._inflight is not None:
            self._inflight.exception()
        self._reap(raising=True)
        if self._inflight is not None:
            return None
        digests = self._take()  # (enqueued before the save's consistent point: both see one state)
        pending = self._ckpt.save(self.app_state, tag=transport.round_tag(self._seq + 1, final=False))
        self._seq += 1
        self._inflight, self._inflight_seq = pending, self._seq
        self._inflight_digests = digests
        if wait:
            pending.exception()
            self._reap(raising=True)
        return pending

    def handoff(self) -> HandoffInfo:
        """At a step or request boundary: save the last delta synchronously, tell the
        target, and stop. From its return on, ``app_state`` belongs to the target: the
        program must not use it (a later ``precopy()``/``handoff()`` raises).

        If the last round fails (a :class:`MigrationError` naming why), nothing was handed
        off: the program still owns its state and may go on, or call ``handoff()`` again.
        """
        self._check_running("handoff()")
        started = time.perf_counter()
        if self._inflight is not None:
            self._inflight.exception()  # (its failure does not matter: the last round carries everything)
        self._reap(raising=False)
        fast = self._fast_handoff(started)
        if fast is not None:
            return fast
        tag = transport.round_tag(self._seq + 1, final=True)
        try:
            info = self._ckpt.save(self.app_state, tag=tag, blocking=True).wait()
        except CheckpointError as exc:
            raise MigrationError(f"the handoff round of {self.address} failed: {exc}; nothing was handed off: the "
                                 "program still owns its state (go on, or call handoff() again)") from exc
        self._seq += 1
        self._state = "handed off"
        self._left.handed_off = True
        final = self._round_info(info.id, self._seq, True, info.stats)
        self._rounds.append(final)
        self._committed.append(info.id)
        self._ring()
        handoff_s = time.perf_counter() - started
        self._after_handoff(fast=False)
        return HandoffInfo(final, handoff_s, tuple(self._rounds), general_why=self._why_general)

    def _after_handoff(self, *, fast: bool) -> None:
        self._left.fast = fast
        if self._buffer is not None:
            self._buffer.close(remove=not fast)  # (the target reads a fast handoff's delta there)
        try:
            self._ckpt.close()  # (its threads and the writer lease: nothing more is written)
        except CheckpointError as exc:  # (an earlier round's failure nothing observed: the handoff stands)
            log.warning("gpusnap: migration %s: %s", self.address, exc)

    @property
    def rounds(self) -> tuple[RoundInfo, ...]:
        """The rounds committed so far, oldest first (the handoff last, once made)."""
        return tuple(self._rounds)

    @property
    def handed_off(self) -> bool:
        """Whether :meth:`handoff` succeeded: the state is the target's now."""
        return self._state == "handed off"

    # -- life cycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Before the handoff: call the migration off (a target waiting fails: the source is
        gone) and remove the transport if this Source made it. After it: let go of the
        transport, which the target removes once it has received everything."""
        if self._state == "closed":
            return
        handed_off = self._state == "handed off"
        self._state = "closed"
        try:
            if not handed_off:
                if self._inflight is not None:
                    self._inflight.exception()
                    self._inflight = None
                self._ckpt.close()
        finally:
            self._left.clean(handed_off=handed_off)

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Source({self.address!r}, {self._state}, rounds={len(self._rounds)})"

    # -- the fast handoff -----------------------------------------------------------------------
    def _take(self) -> Digests | None:
        """The digests of the state now, for the round about to start (None: no fast handoff
        from this round; the first call also starts preparing the bytes file)."""
        if not self._fast:
            return None
        try:
            flat = flatten(self.app_state, allow_pickle=self._allow_pickle, plan=self._plan)
            self._plan = flat.plan
            digests = take(flat, self.config.chunk_size)
            if digests is not None and self._buffer is None and self._no_buffer is None:
                self._make_buffer(flat)
            return digests
        except Exception as exc:  # noqa: BLE001  (the round's save says what is wrong with the state)
            log.debug("gpusnap: migration %s: no fast handoff from this round: %s", self.address, exc)
            return None

    def _make_buffer(self, flat: FlatState) -> None:
        """Start preparing the bytes file, sized for this state and the room left beside the
        rounds (none: ``_no_buffer`` says so, and every handoff goes the general way)."""
        local = transport.local_path(self.address)
        assert local is not None
        where = os.path.join(local, transport.MIGRATE)
        vfs = os.statvfs(where)
        capacity = capacity_for([sp.nbytes for sp in flat.spans], self.config.chunk_size,
                                vfs.f_bavail * vfs.f_frsize)
        if capacity == 0:
            self._no_buffer = f"no room beside the rounds in {where} for the fast handoff's buffer"
            return
        cuda = next((sp.device for sp in flat.spans if sp.device.type == "cuda"), None)
        self._buffer = self._left.buffer = DeltaBuffer(os.path.join(where, buffer_name(self._token)), capacity,
                                                       page_lock=cuda)

    def _fast_handoff(self, started: float) -> HandoffInfo | None:
        """The handoff as a delta on the newest round (module docstring), or None (the
        general way; ``_why_general`` says why)."""
        why, claim = self._fast_refusal()
        self._why_general = why
        if why is not None:
            return None
        assert self._base is not None and self._buffer is not None and claim is not None
        base_id, base = self._base
        try:
            flat = flatten(self.app_state, allow_pickle=self._allow_pickle, plan=self._plan)
            now = take(flat, self.config.chunk_size)
            if now is None:
                self._why_general = "the state's CPU tensors are too large to digest"
                return None
            runs = changed_runs(base, now)
            whole = claim.get("whole")
            if runs is None or not isinstance(whole, list) or not all(
                    type(i) is int and 0 <= i < len(flat.spans) for i in whole):
                self._why_general = "the state was laid out otherwise than at the last round"
                return None
            runs = with_whole_spans(runs, whole, [sp.nbytes for sp in flat.spans])
            need = delta_bytes(runs)
            if need > self._buffer.capacity:
                self._why_general = (f"the delta ({need} bytes) is larger than the fast handoff's buffer "
                                     f"({self._buffer.capacity} bytes)")
                return None
            header = write_delta(self._buffer, flat, runs, now, token=self._token, base=base_id, seq=self._seq + 1)
            transport.write_json(self._backend, DELTA_HEADER, header.to_doc())
        except Exception as exc:  # noqa: BLE001  (the general way still hands off; said here)
            log.warning("gpusnap: migration %s: the fast handoff failed (%s); handing off the general way",
                        self.address, exc)
            self._why_general = f"the fast handoff failed: {exc}"
            return None
        self._seq += 1
        self._state = "handed off"
        self._left.handed_off = True
        handoff_s = time.perf_counter() - started
        final = RoundInfo(id=base_id, seq=self._seq, final=True, bytes_total=sum(header.spans),
                          bytes_moved=sum(r.stop - r.start for r in header.runs), stall_s=handoff_s,
                          duration_s=handoff_s, fast=True)
        self._rounds.append(final)
        self._ring()
        self._after_handoff(fast=True)
        return HandoffInfo(final, time.perf_counter() - started, tuple(self._rounds))

    def _fast_refusal(self) -> tuple[str | None, dict[str, Any] | None]:
        """Why this handoff cannot be a fast one (None: it can), and the target's claim."""
        if not self._fast:
            return ("Source(fast_handoff=False)" if not self._fast_asked else
                    "the transport is not a local directory"), None
        if self._no_buffer is not None:
            return self._no_buffer, None
        if self._base is None or self._buffer is None or not self._committed or self._committed[-1] != self._base[0]:
            return "no round whose digests were taken is the newest (none yet, or the last one was retried)", None
        if not self._buffer.wait_ready():
            return f"the fast handoff's buffer could not be made: {self._buffer.error}", None
        claim = self._claim()
        # (what the claim says of the target's tensors holds for the round it names: the newest)
        if claim is None or claim.get("applied") != self._base[0]:
            return "no live target has applied the newest round (hand off once it has: Target(on_round=...))", None
        if claim.get("fast") is not True:
            return "the target's tensors cannot take a delta in place (laid out otherwise, or resharded)", None
        return None, claim

    # -- inside -------------------------------------------------------------------------------
    def _check_running(self, what: str) -> None:
        if self._state != "running":
            raise MigrationError(f"{what}: this Source has {self._state}; its state belongs to the target now"
                                 if self._state == "handed off" else f"{what}: this Source is closed")

    def _reap(self, *, raising: bool) -> None:
        """The round in flight, once committed: recorded, the target told, old rounds deleted."""
        pending = self._inflight
        if pending is None or not pending.done():
            return
        self._inflight = None
        digests, self._inflight_digests = self._inflight_digests, None
        error = pending.exception(0)
        if error is not None:
            if raising:
                raise MigrationError(f"round {self._inflight_seq} of the migration to {self.address} failed: {error} "
                                     "(the source goes on; the next round carries what it would have)") from error
            return
        info = pending.wait(0)
        # a round that failed validation and was retried holds a later state than its digests
        retried = info.stats.get("consistent_point") == "retry"
        self._base = (info.id, digests) if digests is not None and not retried else None
        self._rounds.append(self._round_info(info.id, self._inflight_seq, False, info.stats))
        self._committed.append(info.id)
        self._retain()
        self._ring()

    def _round_info(self, cid: str, seq: int, final: bool, stats: dict[str, Any]) -> RoundInfo:
        return RoundInfo(id=cid, seq=seq, final=final, bytes_total=int(stats.get("bytes_total", 0)),
                         bytes_moved=int(stats.get("bytes_written", 0)), stall_s=float(stats.get("stall_s", 0.0)),
                         duration_s=float(stats.get("duration_s", 0.0)))

    def _claim(self) -> dict[str, Any] | None:
        """The live target's claim file, or None (no target, or one that died)."""
        doc = transport.read_json(self._backend, transport.TARGET_FILE)
        if doc is None:
            return None
        local = transport.local_path(self.address)
        if local is not None:
            alive = transport.flock_held(os.path.join(local, transport.TARGET_LOCK))
        else:
            alive = transport.process_alive(doc) is not False
        return doc if alive else None

    def _retain(self) -> None:
        """Delete every round but the newest and the one the target reads. Safe against a
        target choosing a round meanwhile: it claims one and then checks that it is still
        the newest (target.py), so a round it may read is either the newest here or was
        claimed before this read of its claim."""
        claim = self._claim()
        reading = claim.get("reading") if claim else None
        if not isinstance(reading, str):  # (a claim file this code did not write: it keeps nothing)
            reading = None
        keep = {self._committed[-1], reading}
        for cid in list(self._committed[:-1]):
            if cid in keep:
                continue
            try:
                self._ckpt.delete(cid)
            except CheckpointError as exc:  # (the transport keeps a round more: only memory)
                log.warning("gpusnap: migration %s: could not delete round %s: %s", self.address, cid, exc)
                continue
            self._committed.remove(cid)

    def _ring(self) -> None:
        claim = self._claim()
        local = transport.local_path(self.address)
        bell = claim.get("bell") if claim else None
        if local is not None and isinstance(bell, str) and "/" not in bell:
            ring(os.path.join(local, transport.MIGRATE, bell))



class _Leftovers:
    """What a Source leaves to clean (no reference to the Source, so that a finalizer can
    hold it): its lock, and the transport it made unless it handed off. Only the process
    that made them cleans (a forked child exiting must not remove its parent's transport)."""

    def __init__(self, made_root: str | None) -> None:
        self.made_root = made_root
        self.lock: transport.Flock | None = None
        self.buffer: DeltaBuffer | None = None  # (unmapped, unlocked, and gone unless a fast handoff's)
        self.handed_off = False
        self.fast = False
        self.pid = os.getpid()

    def clean(self, *, handed_off: bool | None) -> None:
        if os.getpid() != self.pid:
            return
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        handed = self.handed_off if handed_off is None else handed_off
        buffer, self.buffer = self.buffer, None
        if buffer is not None:
            buffer.close(remove=not (handed and self.fast))
        root, self.made_root = self.made_root, None
        if root is not None and not handed:
            transport.remove_root(root)
