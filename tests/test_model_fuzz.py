"""A model-based fuzzer of the save/promote/restore life cycle (hypothesis stateful testing).

Random sequences of in-place writes (through views and tied weights too), frees and resizes,
saves (blocking or concurrent, promoted or not, tagged or not, bursts of overlapping ones),
waits, deletes (also of a checkpoint just saved, its promotion in flight), eager and lazy
restores (into a blank state and into the live one), removals of the fast root (between saves
or under them), one-shot full-disk faults and held promotions at the durable root's backend,
forks, and close/reopen run against a Checkpointer with a fast tier, while a plain *shadow*
state (which gpusnap never sees) takes the same writes. The model checks:

* the live state always equals the shadow (copy-on-write, lazy restores and forked children
  never change what the program sees);
* every listed checkpoint (either tier) restores bit-exactly to the shadow at its ``save()``,
  also from the durable root alone; a deleted one never reappears;
* a save commits (and is then listed while retention keeps it) or its ``wait()`` raises,
  and only where the model allows a failure (the fast root removed under it, a skip);
* ``Checkpointer.wait()``/``close()``/``restore()`` raise exactly the failures nothing has
  observed, each once; one that returns normally leaves every ``promote=True`` save durable
  (unless retention, a delete, or a reported failure explains it);
* ``keep_last`` and ``fast_keep_last`` hold within one save (plus what promotions pin), and
  the fast tier's slabs stay bounded.

CI runs a few hundred examples from a fixed seed (derandomized: the same every run, about a
minute on 2 cores). The long run, 100 times as many from a new seed each time (hours)::

    GPUSNAP_FUZZ=long .venv/bin/python -m pytest tests/test_model_fuzz.py

A failure prints hypothesis' minimal sequence of steps and a ``@reproduce_failure`` blob
(a failure that depends on thread timing may replay only sometimes: "Flaky", steps printed).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import pytest
import torch
from fast_support import same, snapshot
from fuzz_support import (
    DurableBackend,
    blank_for,
    durable_backends,
    fork_child,
    load_snapshot,
    make_state,
    write,
)
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

import gpusnap
from gpusnap.storage.fast_tier import ALIGN

LONG = os.environ.get("GPUSNAP_FUZZ", "") == "long"
EXAMPLES = 200
STEPS = 20
SETTINGS = settings(
    max_examples=EXAMPLES * (100 if LONG else 1),
    stateful_step_count=STEPS,
    deadline=None,
    derandomize=not LONG,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
WRITES = ("train", "tied", "x", "x_slice", "view", "view_t", "base", "plain")
PIECE, SLAB = 1024, 16384  # copy pieces and fast-tier slabs (the state: 512-byte chunks)
GRACE_S = 0.5  # a step held this long while promotions are held waits for one: release them
PROMOTION_FAILED = "promoting to the durable root"
F = TypeVar("F", bound=Callable[..., Any])


def bounded(step: F) -> F:
    """A step that never waits for held promotions for longer than GRACE_S, and whose failure
    is raised at teardown, the later steps skipped: a failure that depends on timing then
    still ends every run of its example at the same step, so hypothesis can shrink it."""

    @functools.wraps(step)
    def run(self: Fuzz, *args: Any, **kwargs: Any) -> None:
        if self.failure is not None:
            return
        self.steps.append(f"{step.__name__}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})")
        try:
            with self.backend.watchdog(GRACE_S):
                step(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001  (raised by teardown)
            self.failure = exc
            note(f"failed in {step.__name__}: {exc!r}")

    return run  # type: ignore[return-value]


@dataclass
class Save:
    id: str
    tag: str | None
    promote: bool
    pending: gpusnap.PendingSave
    expected: dict[str, Any]
    status: str = "pending"  # -> "committed" | "failed"
    info: gpusnap.CheckpointInfo | None = None
    error: BaseException | None = None
    epoch: int = 0  # fast roots removed before it was saved
    may_fail: bool = False  # the fast root was removed while it was in flight

    def created(self) -> tuple[float, str]:
        assert self.info is not None
        return (self.info.created, self.id)


class Fuzz(RuleBasedStateMachine):
    backends: ClassVar[dict[str, DurableBackend]] = {}  # set by the test: Repository.open's injected backends

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="gpusnap-fuzz-"))
        self.durable, self.fast = self.dir / "durable", self.dir / "fast"
        self.backend = DurableBackend(self.durable)
        self.backends[str(self.durable)] = self.backend
        self.ck: gpusnap.Checkpointer | None = None
        self.saves: list[Save] = []
        self.by_id: dict[str, Save] = {}
        self.deleted: set[str] = set()
        self.gone: set[str] = set()  # lost with a removed fast root, or with a failed delete
        self.epoch = 0  # fast roots removed
        self.excused: set[str] = set()  # promote=True, but a reported failure explains it not durable
        self.accounted = 0  # backend faults explained (raised, or cleared by a later promotion)
        self.since_idle: list[Save] = []  # saves whose promotions may still run
        self.pins_may_fail = False  # a promotion from a removed fast root may fail
        self.lazy: gpusnap.RestoreHandle | None = None
        self.failure: Exception | None = None  # the first step's that failed (raised at teardown)
        self.steps: list[str] = []  # (what ran, for the record)
        self.tags = 0

    # -- set-up ------------------------------------------------------------------------------
    @initialize(fast_keep_last=st.integers(1, 3), keep_last=st.sampled_from([None, 1, 2, 3]),
                promote_every=st.sampled_from([None, 2, 5]), tracked=st.booleans(), small_cow=st.booleans(),
                skip=st.booleans(), x_len=st.integers(1, 400), held=st.booleans())
    @bounded
    def init(self, fast_keep_last: int, keep_last: int | None, promote_every: int | None, tracked: bool,
             small_cow: bool, skip: bool, x_len: int, held: bool) -> None:
        """``held``: promotions run only while the program waits for them (or after
        release_promotions): each is in flight across the steps before, as on a slow root."""
        # the few KiB of state span several chunks, pieces and slabs; tracked: CPU spans are
        # copied while the program runs (not all at save()), through copy-on-write (small_cow:
        # a shadow budget of one chunk, so writes mostly wait for copies)
        self.config = gpusnap.Config(
            chunk_size=512, copy_piece_bytes=PIECE, fast_slab_bytes=SLAB, retry_validation=False,
            cpu_snapshot_bytes=0 if tracked else 64 << 20, eager_cpu_bytes=0 if tracked else 64 * 1024,
            cow_budget_bytes=512 if small_cow else 0, when_busy="skip" if skip else "wait")
        self.fast_keep_last, self.keep_last, self.promote_every = fast_keep_last, keep_last, promote_every
        self.live, self.plain = make_state(1, x_len), make_state(1, x_len)
        self.held = held
        if held:
            self.backend.hold()
        self.ck = self._open()

    def _open(self) -> gpusnap.Checkpointer:
        return gpusnap.Checkpointer(self.durable, fast_root=self.fast, config=self.config, keep_last=self.keep_last,
                                    fast_keep_last=self.fast_keep_last, promote_every=self.promote_every)

    def teardown(self) -> None:
        try:
            if self.failure is not None:
                self.backend.release()
                if self.ck is not None:
                    with contextlib.suppress(Exception):  # (the failure found first is the one to report)
                        self.ck.close()
                raise self.failure
            if self.ck is not None:
                self._drain(self.ck.close, "close()", check=False)
                self.ck = self._open()  # (what close() left, read through a new Checkpointer)
                self._check_idle("close()")
                self._check_all()
                self._drain(self.ck.close, "close()", check=False)
        finally:
            self.backend.release()
            self.backends.pop(str(self.durable), None)
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- the program: writes, frees, resizes ----------------------------------------------------
    @rule(kind=st.sampled_from(WRITES), k=st.integers(1, 9))
    @bounded
    def write(self, kind: str, k: int) -> None:
        write(self.live, kind, k)
        write(self.plain, kind, k)

    @rule(n=st.integers(1, 400), k=st.integers(1, 9))
    @bounded
    def replace_x(self, n: int, k: int) -> None:
        """The old tensor is dropped (its memory freed, maybe under a pending copy)."""
        for s in (self.live, self.plain):
            s["x"] = torch.arange(n, dtype=torch.float32) * k

    @rule(n=st.integers(1, 400))
    @bounded
    def resize_x(self, n: int) -> None:
        """In place: the same tensor, its storage reallocated when it grows."""
        for s in (self.live, self.plain):
            x = s["x"]
            old = x.numel()
            x.resize_(n)
            if n > old:
                x[old:] = 0.25

    @rule(k=st.integers(1, 9))
    @bounded
    def fork(self, k: int) -> None:
        """A forked child (a data-loader worker) reads and writes the state, and exits; the
        parent's state and saves are not its business."""
        status, said = fork_child(self.live, self.plain, k)
        assert status == 0, f"the forked child exited with {status}: {said}"

    # -- saves and waits ------------------------------------------------------------------------
    @rule(blocking=st.booleans(), promote=st.booleans(), tagged=st.booleans())
    @bounded
    def save(self, blocking: bool, promote: bool, tagged: bool) -> None:
        self._save(blocking, promote, tagged)

    @rule(n=st.integers(2, 12), promote_at=st.integers(0, 15))
    @bounded
    def train_and_save(self, n: int, promote_at: int) -> None:
        """A training loop that saves at every step and waits for none (the saves overlap);
        the listing is checked after each."""
        for i in range(n):
            write(self.live, "train", i + 1)
            write(self.plain, "train", i + 1)
            self._save(False, i == promote_at, False)
            self._check_listing()

    def _save(self, blocking: bool, promote: bool, tagged: bool) -> Save | None:
        assert self.ck is not None
        tag = None
        if tagged:
            self.tags += 1
            tag = f"t{self.tags}"
        expected = snapshot(self.plain)
        fired = len(self.backend.fired)
        try:
            pending = self.ck.save(self.live, tag=tag, blocking=blocking, promote=promote)
        except gpusnap.SaveSkipped:  # (blocking: its wait() raised it)
            assert blocking and self.config.when_busy == "skip"
            return None
        except gpusnap.StorageError as exc:  # (a tag is checked against the durable root: it failed)
            assert self.backend.fired[fired:] and self.backend.fired[-1][1], f"save() raised {exc!r}"
            return None
        s = Save(pending.id, tag, promote, pending, expected, epoch=self.epoch)
        assert pending.id not in self.by_id, f"save() reused the id {pending.id}"
        note(f"save {pending.id} tag={tag} promote={promote} blocking={blocking}")
        self.saves.append(s)
        self.by_id[s.id] = s
        self.since_idle.append(s)
        if blocking:
            assert pending.done(), "a blocking save returned before it was done"
            self._harvest(s, waited=True)
        return s

    @rule(i=st.integers(0, 7))
    @bounded
    def wait_pending(self, i: int) -> None:
        pending = [s for s in self.saves if s.status == "pending"]
        if not pending:
            return
        self._harvest(pending[-1 - i % len(pending)], waited=True)

    @rule()
    @bounded
    def wait_all(self) -> None:
        assert self.ck is not None
        self._drain(self.ck.wait, "Checkpointer.wait()")

    @rule()
    @bounded
    def close_and_reopen(self) -> None:
        assert self.ck is not None
        self._drain(self.ck.close, "close()", check=False)
        self.ck = self._open()
        self._check_idle("close()")

    def _harvest(self, s: Save, *, waited: bool) -> None:
        """Learn how ``s`` ended (it is done); ``waited``: through its own ``wait()``."""
        try:
            info = s.pending.wait()
        except gpusnap.CheckpointError as exc:
            s.status, s.error = "failed", exc
            skipped = isinstance(exc, gpusnap.SaveSkipped) and self.config.when_busy == "skip"
            assert s.may_fail or skipped, f"save {s.id} failed where nothing explains it: {exc!r}"
            return
        s.status, s.info = "committed", info
        assert info.id == s.id and info.tag == s.tag, (info, s)
        if waited and s is self.saves[-1] and s.id not in self.gone | self.deleted:  # retention keeps the newest
            listed = {i.id for i in self._list()}
            assert s.id in listed, f"save {s.id} committed but is not listed: {sorted(listed)}"

    def _drain(self, call: Callable[[], Any], what: str, *, check: bool = True) -> Any:
        """Run ``call``, which first waits for every save and promotion: it must raise each
        failure nothing has observed, once (its calls again raise the rest), then return
        (``check``: then check what that promises, through ``self.ck``)."""
        self.backend.release()
        try:
            for _ in range(5):
                try:
                    result = call()
                except gpusnap.CheckpointError as exc:
                    self._explain(exc, what)
                    continue
                self._idle(what)
                if check:
                    self._check_idle(what)
                return result
            raise AssertionError(f"{what} kept raising")
        finally:
            if self.held:
                self.backend.hold()

    def _explain(self, exc: BaseException, what: str) -> None:
        unwaited = [s for s in self.saves if s.status == "pending"]
        assert all(s.pending.done() for s in unwaited), f"{what} raised {exc!r} before every save was done"
        for s in unwaited:
            self._harvest(s, waited=False)
        newly_failed = [s for s in unwaited if s.status == "failed" and not isinstance(s.error, gpusnap.SaveSkipped)]
        if PROMOTION_FAILED in str(exc) and not any(exc is s.error for s in newly_failed):
            fired = len([f for f in self.backend.fired if not f[1]])
            assert fired > self.accounted or self.pins_may_fail, (
                f"{what} raised a promotion failure that no fault explains: {exc!r}")
            assert not newly_failed, f"{what} raised a promotion failure before save failures: {newly_failed}"
            self.accounted = fired
            self._excuse_not_durable(str(exc))
            return
        assert any(exc is s.error for s in newly_failed), (
            f"{what} raised {exc!r}, which is the error of no save that failed unobserved")

    def _idle(self, what: str) -> None:
        """``what`` returned normally: every save and promotion is done, every failure raised."""
        for s in [s for s in self.saves if s.status == "pending"]:
            assert s.pending.done(), f"{what} returned before save {s.id} was done"
            self._harvest(s, waited=False)
            assert s.status == "committed" or isinstance(s.error, gpusnap.SaveSkipped), (
                f"{what} returned normally, but save {s.id} had failed unobserved: {s.error!r}")
        self.accounted = len([f for f in self.backend.fired if not f[1]])  # raised, or cleared by a success
        self.since_idle = []
        self.pins_may_fail = False

    def _check_idle(self, what: str) -> None:
        self._check_promoted(what)
        self._check_newest_listed(what)

    def _excuse_not_durable(self, error: str) -> None:
        """A promotion failure was raised: the promote=True saves it names (every one not
        durable, where it names none) need not be durable."""
        durable = {i.id for i in self._list() if i.tier == "durable"}
        named = [s for s in self.saves if s.id in error] or self.saves
        self.excused |= {s.id for s in named if s.promote and s.id not in durable}

    def _check_promoted(self, what: str) -> None:
        """Every committed promote=True save is durable, unless retention, a delete or a
        reported failure explains it."""
        infos = self._list()
        durable = {i.id: i for i in infos if i.tier == "durable"}
        for s in self.saves:
            if not s.promote or s.status != "committed" or s.id in durable:
                continue
            if s.id in self.deleted or s.id in self.excused or s.id in self.gone:
                continue
            newer = [o for o in self.saves if o.status == "committed" and o.created() > s.created()
                     and (o.promote or self.promote_every is not None)]
            if self.keep_last is not None and len(newer) >= self.keep_last:
                continue  # (durable retention may have dropped it)
            where = "the fast tier only" if s.id in {i.id for i in infos} else "neither tier"
            raise AssertionError(f"{what} returned normally, but save {s.id} (promote=True, tag {s.tag}) is in "
                                 f"{where}; durable: {sorted(durable)}")

    def _check_newest_listed(self, what: str) -> None:
        """Fast retention keeps the newest fast_keep_last committed checkpoints of the tier
        (those saved since its root was last removed; deleted ones count until deleted)."""
        tier = [s for s in self.saves if s.status == "committed" and s.epoch == self.epoch and not s.may_fail]
        tier.sort(key=Save.created)
        listed = {i.id for i in self._list()}
        lost = [s.id for s in tier[-self.fast_keep_last:] if s.id not in listed | self.deleted | self.gone]
        assert not lost, f"after {what}: committed checkpoints {lost} are missing from {sorted(listed)}"

    # -- deletes, restores ----------------------------------------------------------------------
    @rule(which=st.sampled_from(["newest", "promoted", "any"]), i=st.integers(0, 7), by_tag=st.booleans())
    @bounded
    def delete(self, which: str, i: int, by_tag: bool) -> None:
        """Delete the newest listed checkpoint, the newest saved with promote=True (its
        promotion may be in flight), or any."""
        assert self.ck is not None
        listed = self._list()
        if which == "promoted":
            listed = [info for info in listed if self.by_id[info.id].promote]
        if not listed:
            return
        target = listed[-1] if which != "any" else listed[-1 - i % len(listed)]
        self._delete(target.tag if by_tag and target.tag is not None else target.id, target.id)

    @rule(promote=st.booleans(), by_tag=st.booleans())
    @bounded
    def save_and_drop(self, promote: bool, by_tag: bool) -> None:
        """A trainer's top-k retention: a checkpoint saved (and waited for) that did not make
        the cut is deleted at once, its promotion maybe in flight."""
        s = self._save(True, promote, by_tag)
        if s is not None and s.status == "committed":
            self._delete(s.tag if by_tag and s.tag is not None else s.id, s.id)

    def _delete(self, ref: str, target: str) -> None:
        assert self.ck is not None
        fired = len(self.backend.fired)
        try:
            self.ck.delete(ref)
            error: BaseException | None = None
        except (gpusnap.CheckpointError, OSError) as exc:
            error = exc
        note(f"delete {target} ({ref}): {error!r}")
        if error is None:
            self.deleted.add(target)
        elif "still being saved" in str(error):  # listed once committed, deletable once its save is done
            assert self.by_id[target].status == "pending", f"delete({ref!r}): {error!r}"
        elif isinstance(error, gpusnap.CheckpointNotFoundError):  # retention took it meanwhile
            assert target not in {i.id for i in self._list()}, f"delete({ref!r}) found no checkpoint: {error!r}"
            self.deleted.add(target)
        else:
            assert len(self.backend.fired) > fired and self.backend.fired[-1][1], f"delete({ref!r}) failed: {error!r}"
            self.gone.add(target)  # (a delete that failed midway may have removed it from a tier)
        assert target not in {i.id for i in self._list()} or error is not None, (
            f"delete({ref!r}) returned, but {target} is still listed")

    def _listed_target(self, i: int) -> tuple[Any, Any] | None:
        """After every pending save: the ``i``-th newest listed checkpoint (wrapping) and the
        state expected in it, or None when nothing is listed."""
        assert self.ck is not None
        self._drain(self.ck.wait, "Checkpointer.wait()")
        listed = self._list()
        if not listed:
            return None
        target = listed[-1 - i % len(listed)]
        return target, self.by_id[target.id].expected

    @rule(i=st.integers(0, 7), lazy=st.booleans())
    @bounded
    def restore_blank(self, i: int, lazy: bool) -> None:
        """Restore a listed checkpoint into a fresh state: it equals the state at its save()."""
        assert self.ck is not None
        ck = self.ck
        picked = self._listed_target(i)
        if picked is None:
            return
        target, expected = picked
        blank = blank_for(expected)
        handle = self._drain(lambda: ck.restore(blank, target.id, lazy=lazy), "restore()")
        if lazy:
            blank["x"].sum()  # waits for x
        handle.wait()
        wrong = same(snapshot(blank), expected)
        assert not wrong, f"checkpoint {target.id} ({target.tier}) restored wrong values at {wrong}"

    @rule(i=st.integers(0, 7), lazy=st.booleans())
    @bounded
    def restore_live(self, i: int, lazy: bool) -> None:
        """Restore into the live state (lazy: the next steps run while it loads); the shadow
        takes the checkpoint's values."""
        assert self.ck is not None
        ck = self.ck
        picked = self._listed_target(i)
        if picked is None:
            return
        target, expected = picked
        if self.live["x"].shape != expected["x"].shape:
            self.live["x"] = torch.empty(expected["x"].shape)
        self.lazy = self._drain(lambda: ck.restore(self.live, target.id, lazy=lazy), "restore()")
        load_snapshot(self.plain, expected)
        assert not same(snapshot(self.plain), expected), "(the shadow state could not take the checkpoint)"
        note(f"restore {target.id} into the live state, lazy={lazy}")

    # -- faults ---------------------------------------------------------------------------------
    @rule(between_saves=st.booleans())
    @bounded
    def remove_fast_root(self, between_saves: bool) -> None:
        """A cleaned /dev/shm: the fast tier's checkpoints are gone, it is made again at the
        next save. ``between_saves``: every save is done first (promotions may still run,
        reading the removed tier's memory); else saves in flight may fail."""
        if between_saves:
            for s in [s for s in self.saves if s.status == "pending"]:
                self._harvest(s, waited=False)
        durable = {i.id for i in self._list() if i.tier == "durable"}
        for _ in range(100):  # (a file made meanwhile by a save in flight fails one pass)
            shutil.rmtree(self.fast, ignore_errors=True)
            if not self.fast.exists():
                break
        assert not self.fast.exists(), f"{self.fast} could not be removed"
        self.epoch += 1
        in_flight = [s for s in self.saves if s.status == "pending"]
        for s in in_flight:
            s.may_fail = True
        self.gone |= {s.id for s in self.saves if s.id not in durable}
        if in_flight:  # (their promotions, and those of the checkpoints they would have replaced)
            self.pins_may_fail = True  # a promotion from the removed tier may fail (and says so)

    @rule(what=st.sampled_from(["open", "rename"]))
    @bounded
    def durable_disk_full(self, what: str) -> None:
        """The durable root's disk is full for one write (a promotion's, or a delete's)."""
        self.backend.arm(what)

    @rule()
    @bounded
    def hold_promotions(self) -> None:
        """The next write a promotion makes waits (a slow durable root) until a rule that
        waits for promotions, or release_promotions."""
        self.backend.hold()

    @rule()
    @bounded
    def release_promotions(self) -> None:
        self.backend.release()

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    @bounded
    def live_state_is_the_shadow(self) -> None:
        if self.ck is None or (self.lazy is not None and not self.lazy.done()):
            return  # (checked once the lazy restore is done: reading now would wait for it)
        wrong = same(snapshot(self.live), snapshot(self.plain))
        assert not wrong, f"the live state differs from the shadow at {wrong}"

    @invariant()
    @bounded
    def listing(self) -> None:
        if self.ck is not None:
            self._check_listing()

    def _check_listing(self) -> None:
        infos = self._list()
        ids = [i.id for i in infos]
        assert len(ids) == len(set(ids)), f"listed twice: {ids}"
        for info in infos:
            assert info.id in self.by_id, f"an unknown checkpoint {info.id} is listed"
            assert info.id not in self.deleted, f"the deleted checkpoint {info.id} reappeared ({info.tier})"
            assert info.tag == self.by_id[info.id].tag, (info, self.by_id[info.id])
        fast = [i.id for i in infos if i.tier == "fast"]
        durable = [i.id for i in infos if i.tier == "durable"]
        # what retention keeps: fast_keep_last, one just committed before its retention runs, one
        # just promoted before its own; those pinned: each explicit promotion not yet done, a
        # running and a waiting cadence one, and one per failed promotion
        failed_pins = len([f for f in self.backend.fired if not f[1]])
        pins = sum(s.promote for s in self.since_idle) + (2 if self.promote_every and self.since_idle else 0)
        assert len(fast) <= self.fast_keep_last + 2 + pins + failed_pins, (
            f"{len(fast)} fast checkpoints listed (fast_keep_last={self.fast_keep_last}, {pins} may be pinned "
            f"by promotions, {failed_pins} by failed ones): {fast}")
        if self.keep_last is not None:
            assert len(durable) <= self.keep_last + 1, f"{len(durable)} durable listed (keep_last={self.keep_last})"
        slabs = self.fast / "slabs"
        if slabs.is_dir():  # those kept, pinned, being written, and made ahead for the next one
            n = len(os.listdir(slabs))
            per_save = math.ceil(self._room() / (SLAB - PIECE))
            bound = (self.fast_keep_last + 3 + pins + failed_pins) * per_save + 2
            assert n <= bound, f"{n} slabs for checkpoints of {self._room()} bytes (at most {bound})"

    # -- checks ---------------------------------------------------------------------------------
    def _list(self) -> list[gpusnap.CheckpointInfo]:
        assert self.ck is not None
        try:
            return self.ck.list()
        except gpusnap.CheckpointError as exc:
            there = sorted(str(p.relative_to(self.fast)) for p in self.fast.rglob("*")) if self.fast.exists() else None
            raise AssertionError(f"list() raised {exc!r}; the fast root holds {there}") from exc

    def _room(self) -> int:
        """Slab bytes a checkpoint of the largest state saved takes at most: each storage's
        bytes, each of its pieces in a page-aligned region."""
        x_max = max([s.expected["x"].numel() for s in self.saves] + [self.live["x"].numel()])
        sizes = [4 * x_max] + [4 * t.numel() for t in snapshot(self.live).values() if isinstance(t, torch.Tensor)]
        return sum(n + -(-n // PIECE) * ALIGN for n in sizes)  # (an upper bound: views and ties counted apart)

    def _check_all(self) -> None:
        """Every listed checkpoint restores bit-exactly, from the fast tier where it is there,
        and from the durable root alone."""
        assert self.ck is not None
        infos = self.ck.list()
        for info in infos:
            assert info.id not in self.deleted, f"the deleted checkpoint {info.id} reappeared"
            expected = self.by_id[info.id].expected
            blank = blank_for(expected)
            self.ck.restore(blank, info.id).wait()
            wrong = same(snapshot(blank), expected)
            assert not wrong, f"checkpoint {info.id} ({info.tier}) restored wrong values at {wrong}"
        durable = [i for i in infos if i.tier == "durable"]
        if durable:
            with gpusnap.Checkpointer(self.durable, config=self.config) as reader:
                assert {i.id for i in reader.list()} == {i.id for i in durable}
                for info in durable:
                    expected = self.by_id[info.id].expected
                    blank = blank_for(expected)
                    reader.restore(blank, info.id).wait()
                    wrong = same(snapshot(blank), expected)
                    assert not wrong, f"durable checkpoint {info.id} restored wrong values at {wrong}"


@pytest.mark.timeout(0 if LONG else 600)
def test_model_fuzz() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (the shadow's arithmetic equals the live state's, bit for bit)
    try:
        with durable_backends() as backends:
            Fuzz.backends = backends
            run_state_machine_as_test(Fuzz, settings=SETTINGS)
    finally:
        torch.set_num_threads(threads)
