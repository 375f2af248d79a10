"""A collective Checkpointer's distributed side: ids, the global commit, rank retention, and
the agreement a collective restore needs (docs/distributed.md).

The Checkpointer runs every rank's save exactly as a per-process save into the rank's own
root (``ROOT/ranks/<rank>``); this object is what it asks at four points:

- ``save()`` (calling thread): :meth:`next_save` gives the save's number and id, derived
  from the run id agreed once (:func:`~gpusnap.distributed.group.join`): no message.
- after the rank's manifest is committed (writer thread): :meth:`settle` reports the part
  and blocks until rank 0's decision; rank 0 gathers the parts, checks that the ranks
  agree (tags, keys, kinds, shapes), writes the global manifest, then publishes.
- a save that failed anywhere (any thread): :meth:`fail` reports it, once.
- after each decided save (writer thread): :meth:`retire` drops this rank's parts of saves
  that were never committed or that rank 0's retention retired.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from gpusnap.config import Config
from gpusnap.distributed.exchange import Exchange
from gpusnap.distributed.group import Group, canonical_root, instance_number, join
from gpusnap.distributed.liveness import Liveness
from gpusnap.distributed.messages import Decision, Part
from gpusnap.distributed.protocol import Missing, Rounds
from gpusnap.errors import CheckpointError, CheckpointNotFoundError, RestoreMismatchError
from gpusnap.state.tree import signature, signature_lines
from gpusnap.storage.manifest import Manifest, RankPart
from gpusnap.storage.ranks import RANK_ROOT_DOC, RankedRepository, rank_root, retire_rank_manifests
from gpusnap.storage.repository import Repository

__all__ = ["Collective", "Settled"]

log = logging.getLogger("gpusnap")

_PART_STATS = ("bytes_written", "stall_s", "duration_s", "validation")  # what a part carries of its rank's stats


@dataclass(frozen=True)
class Settled:
    """A committed collective save, as this rank knows it: enough for its CheckpointInfo.
    ``phases`` (seconds, writer thread): ``describe`` (this rank's part: its state's
    signature and manifest checksum), ``decide`` (the messages and the wait for rank 0's
    decision, which rank 0 makes once every part is in: it includes the slowest rank's own
    save), and on rank 0 ``gather`` (its wait for the parts) and ``commit`` (its global
    manifest's atomic write), both within ``decide``."""

    created: float
    nbytes: int
    world_size: int
    phases: dict[str, float]

    @property
    def coordination_s(self) -> float:
        return self.phases["describe"] + self.phases["decide"]


class Collective:
    def __init__(self, root: str, process_group: Any, config: Config, storage_options: dict[str, Any] | None) -> None:
        self.root = root
        self.process_group = process_group
        self.config = config
        self._storage_options = storage_options
        self.rank = dist.get_rank(process_group)
        self.size = dist.get_world_size(process_group)
        self._instance = instance_number(root)  # (ranks make their Checkpointers in the same order)
        self._group: Group | None = None
        self._rounds: Rounds | None = None
        self._liveness: Liveness | None = None
        self._root_repo: RankedRepository | None = None
        self._lock = threading.Lock()
        self._seq = 0
        self._seqs: dict[str, int] = {}  # pending id -> save number
        self._decided: set[int] = set()  # rank 0: saves whose decision is out
        self._open: set[str] = set()  # ids of this rank's saves not settled yet (retention keeps their parts)
        self._restores = 0  # collective restores so far (they number their keys)
        self.broken: str | None = None  # why no later save can be trusted to match across ranks

    @property
    def rank_root(self) -> str:
        return rank_root(self.root, self.rank)

    def rank_repository(self) -> Repository:
        """This rank's own root (created), which the Checkpointer saves into as usual."""
        return Repository.open(self.rank_root, create=True, storage_options=self._storage_options,
                               config=self.config, root_doc=RANK_ROOT_DOC)

    def root_repository(self, *, create: bool) -> RankedRepository:
        """The root of global manifests; rank 0 (``create``) is its one writer."""
        with self._lock:
            if self._root_repo is None:
                repo = RankedRepository.open(self.root, create=create and self.rank == 0,
                                             storage_options=self._storage_options, config=self.config)
                assert isinstance(repo, RankedRepository)
                self._root_repo = repo
            if create and self.rank == 0:
                self._root_repo.claim_writer()
            return self._root_repo

    # -- joining --------------------------------------------------------------------------
    def joined(self, *, saving: bool = True) -> Group:
        """The group, agreed by one collective on this (the calling) thread the first time:
        every rank calls it at its first save or restore."""
        error = None
        if saving and self.rank == 0:
            try:
                self.root_repository(create=True)  # exists before any rank's root is made under it
            except CheckpointError as exc:  # (another writer holds it)
                error = exc
        if self._group is None:
            group = join(self.process_group, self.root, self._instance, self.config.collective_timeout_s, error)
            self._liveness = Liveness(self.root, group.store)
            self._rounds = Rounds(group.store, group.waiter, self.rank, self.size, self._liveness,
                                  float(self.config.collective_timeout_s))
            self._group = group
            if group.root != canonical_root(self.root):
                self.broken = (f"the ranks of a collective Checkpointer must name one root: rank 0 names {group.root}, "
                               f"rank {self.rank} {self.root}")
                self._rounds.report(1, Part(self.rank, f"{group.run_id}-{1:06d}", error=self.broken))
        elif error is not None:
            raise error
        return self._group

    def announce(self) -> None:
        """This rank holds its root's writer lease (called once it does)."""
        assert self._liveness is not None
        self._liveness.announce(self.rank)

    # -- saving ---------------------------------------------------------------------------
    def next_save(self) -> tuple[int, str]:
        """The next save's number and id (the same on every rank that saves as often)."""
        joined = self._group is not None
        try:
            self.joined()
        except CheckpointError as exc:
            if joined:  # (rank 0 lost the root's lease since): the others must not wait for this save
                self.fail(self._allocate()[1], exc)
            raise
        if self.broken is not None:
            raise CheckpointError(
                f"this collective Checkpointer cannot save any more: {self.broken}. Its ranks may no longer "
                "save at the same steps: make a new Checkpointer on every rank (earlier checkpoints are intact)"
            )
        return self._allocate()

    def _allocate(self) -> tuple[int, str]:
        assert self._group is not None
        with self._lock:
            self._seq += 1
            seq = self._seq
            cid = f"{self._group.run_id}-{seq:06d}"
            self._seqs[cid] = seq
            self._open.add(cid)
        return seq, cid

    def tag_owner(self, tag: str) -> str | None:
        """The committed checkpoint tagged ``tag`` (tags live in global manifests)."""
        try:
            return self.root_repository(create=self.rank == 0).tag_owner(tag)
        except CheckpointNotFoundError:
            return None

    def fail(self, checkpoint_id: str, error: BaseException) -> None:
        """A save failed on this rank: rank 0 decides it failed at once, another rank tells
        rank 0 (once; a save whose part was reported is left to its decision)."""
        seq = self._seqs.get(checkpoint_id)
        if seq is None or self._rounds is None:
            return
        with self._lock:
            self._open.discard(checkpoint_id)
        why = f"rank {self.rank}'s part failed: {str(error) or type(error).__name__}"
        try:
            if self.rank == 0:
                self._decide(seq, Decision(checkpoint_id, error=why))
            else:
                self._rounds.report(seq, Part(self.rank, checkpoint_id, error=why))
        except Exception as exc:  # the store is gone: the others find out by their timeout
            log.warning("gpusnap: could not report the failure of %s to the other ranks: %s", checkpoint_id, exc)

    def settle(self, manifest: Manifest, tag: str | None, stats: dict[str, Any]) -> Settled:
        """This rank's part (``manifest``, committed in its root) is durable: report it and
        wait for the decision. Raises CheckpointError when the checkpoint was not committed."""
        assert self._rounds is not None
        seq = self._seqs[manifest.id]
        started = time.perf_counter()
        part = Part(self.rank, manifest.id, tag=tag, signature=signature(manifest.tree), checksum=manifest.checksum,
                    nbytes=manifest.nbytes, stats={k: stats[k] for k in _PART_STATS if k in stats})
        described = time.perf_counter()
        phases = {"describe": described - started}
        try:
            self._rounds.report(seq, part)
            if self.rank == 0:
                decision = self._decide_as_root(seq, manifest, tag, phases)
            else:
                decision = self._await(seq, manifest.id)
        except Exception as exc:  # the store itself failed (its host, rank 0 under tcp:// or env://, died?)
            decision = self._committed_anyway(manifest.id, f"the job's torch.distributed store failed ({exc}); "
                                                           "the rank that hosts it may have died")
        phases["decide"] = time.perf_counter() - described
        if decision.broken and self.broken is None:
            self.broken = decision.error
        with self._lock:
            self._open.discard(manifest.id)
        try:
            self._rounds.forget(seq)
        except Exception:  # (keys left in the store: memory, never a wrong answer)
            pass
        if decision.error is not None:
            raise CheckpointError(f"checkpoint {manifest.id} was not committed: {decision.error}; "
                                  "earlier checkpoints are intact")
        return Settled(decision.created, decision.nbytes, self.size, phases)

    def _decide(self, seq: int, decision: Decision) -> Decision:
        assert self._rounds is not None
        with self._lock:
            if seq in self._decided:
                return decision
            self._decided.add(seq)
        self._rounds.publish(seq, decision)
        return decision

    def _decide_as_root(self, seq: int, own: Manifest, tag: str | None, phases: dict[str, float]) -> Decision:
        assert self._rounds is not None
        gathering = time.perf_counter()
        try:
            parts = self._rounds.gather(seq)
            phases["gather"] = time.perf_counter() - gathering
        except Missing as exc:
            return self._decide(seq, Decision(own.id, error=str(exc), broken=True))
        problem = self._disagreement(own, parts)
        if problem is not None:
            return self._decide(seq, Decision(own.id, error=problem))
        stats = {"world_size": self.size, "ranks": [{"rank": p.rank, "nbytes": p.nbytes, **p.stats} for p in parts]}
        glob = Manifest(id=own.id, tag=tag, created=own.created, chunk_size=own.chunk_size, storages=(),
                        tree={"t": "ranks"}, stats=stats,
                        ranks=tuple(RankPart(p.rank, p.checksum, p.nbytes) for p in parts))
        committing = time.perf_counter()
        try:
            with self.root_repository(create=True).begin_write() as txn:
                txn.commit(glob)
            phases["commit"] = time.perf_counter() - committing
        except Exception as exc:
            return self._decide(seq, Decision(own.id, error=f"rank 0 could not commit the global manifest: {exc}"))
        return self._decide(seq, Decision(own.id, created=glob.created, nbytes=glob.nbytes))

    def _disagreement(self, own: Manifest, parts: list[Part]) -> str | None:
        """Why the parts cannot make one checkpoint, or None."""
        failed = [p.error for p in parts if p.error is not None]
        if failed:
            return "; ".join(failed)
        ids = {p.id for p in parts}
        if ids != {own.id}:
            return f"the ranks saved different checkpoints ({', '.join(sorted(ids))}): their Checkpointers differ"
        tags = [p.tag for p in parts]
        if len(set(tags)) > 1:
            return "the ranks saved with different tags: " + ", ".join(f"rank {p.rank} {p.tag!r}" for p in parts)
        other = next((p for p in parts if p.signature != parts[0].signature), None)
        if other is not None:
            return self._state_difference(own, other)
        return None

    def _state_difference(self, own: Manifest, other: Part) -> str:
        """Name the first key where rank ``other.rank``'s state differs from rank 0's (its rank
        manifest is durable: read it back; only on this failure path)."""
        lead = f"the ranks' app_state differ (keys, kinds, dtypes or shapes): rank 0 and rank {other.rank}"
        try:
            theirs = self.root_repository(create=True).rank_manifest(
                own, RankPart(other.rank, other.checksum, other.nbytes))
        except CheckpointError as exc:
            return f"{lead} ({exc})"
        mine, their_lines = signature_lines(own.tree), signature_lines(theirs.tree)
        for a, b in zip(mine, their_lines):
            if a != b:
                return f"{lead}: rank 0 has {a!r}, rank {other.rank} has {b!r}"
        extra = mine[len(their_lines):] or their_lines[len(mine):]
        holder = 0 if len(mine) > len(their_lines) else other.rank
        return f"{lead}: only rank {holder} has {extra[0]!r}"

    def _await(self, seq: int, checkpoint_id: str) -> Decision:
        assert self._rounds is not None
        try:
            return self._rounds.await_decision(seq)
        except Missing as exc:
            return self._committed_anyway(checkpoint_id, str(exc))

    def _committed_anyway(self, checkpoint_id: str, why: str) -> Decision:
        """No decision came (rank 0 or the store is gone): rank 0 may have committed and died
        before it could say so, and the root tells. Either way the ranks are no longer paired."""
        try:
            committed = self.root_repository(create=False).load_manifest(checkpoint_id)
        except CheckpointError:
            return Decision(checkpoint_id, error=why, broken=True)
        if self.broken is None:
            self.broken = f"{why} (after it committed {checkpoint_id})"
        return Decision(checkpoint_id, broken=True, created=committed.created, nbytes=committed.nbytes)

    def retire(self, rank_repo: Repository, upto: str) -> None:
        """This rank's retention after save ``upto`` was decided (never fails a save)."""
        with self._lock:  # (a blocking save may settle on the caller's thread before an earlier one)
            unsettled = min(self._open, default=None)
        try:
            retire_rank_manifests(rank_repo, self.root_repository(create=self.rank == 0), upto, before=unsettled)
        except Exception as exc:
            log.warning("gpusnap: retention of rank %d's root failed; the next save tries again: %s", self.rank, exc)

    # -- restoring ------------------------------------------------------------------------
    def agreed_checkpoint(self, ref: str | None) -> Manifest:
        """The checkpoint every rank restores: rank 0 resolves ``ref`` and tells the others
        (through the store); an error there is raised on every rank."""
        self.joined(saving=False)
        with self._lock:
            self._restores += 1
        answer = None
        if self.rank == 0:
            try:
                answer = ["ok", self.root_repository(create=False).resolve(ref).id]
            except CheckpointError as exc:
                answer = ["missing" if isinstance(exc, CheckpointNotFoundError) else "error", str(exc)]
        kind, value = self._exchange().from_root(f"restore{self._restores}/choice", answer)
        if kind == "missing":
            raise CheckpointNotFoundError(value)
        if kind == "error":
            raise CheckpointError(f"rank 0 could not resolve the checkpoint to restore: {value}")
        return self.root_repository(create=False).load_manifest(value)

    def agree(self, error: BaseException | None, step: str) -> None:
        """Every rank says whether it met an error at ``step`` of the current restore; if any
        did, every rank raises, naming each rank's (its own error on the rank that met it)."""
        mine = None if error is None else [type(error).__name__, str(error)]
        everyone = self._exchange().every(f"restore{self._restores}/{step.split()[0]}", mine)
        if error is not None:
            raise error
        failed = [(r, e) for r, e in enumerate(everyone) if e is not None]
        if failed:
            named = "; ".join(f"rank {r}: {msg}" for r, (_k, msg) in failed)
            cls = RestoreMismatchError if all(k == "RestoreMismatchError" for _r, (k, _m) in failed) else CheckpointError
            raise cls(f"{step} failed on {len(failed)} rank(s), so it stops on every rank: {named}")

    def _exchange(self) -> Exchange:
        group = self.joined(saving=False)
        return Exchange(group.store, self.rank, self.size, float(self.config.collective_timeout_s))

    def close(self) -> None:
        if self._root_repo is not None:
            self._root_repo.close()
