"""The ``Checkpointer``: gpusnap's facade. It checks arguments and wires the parts together;
the save path is :mod:`gpusnap.save`, the restore path :mod:`gpusnap.restore`.

Save: ``save/`` (tiers -> plan -> engine -> capture -> commit -> after-commit).
Restore: resolve -> plan (all checks, nothing written) -> read, verify and apply in place
(``restore.Restorer``: verify-first, pipelined, or lazy behind a dispatch-mode gate).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, MutableMapping
from typing import Any

from gpusnap import exit_hooks
from gpusnap.config import Config
from gpusnap.distributed.collective import Collective
from gpusnap.distributed.group import collective_group
from gpusnap.distributed.restore import collective_restore
from gpusnap.errors import CheckpointError
from gpusnap.handles import CheckpointInfo, PendingSave, RestoreHandle
from gpusnap.restore.rank_view import rank_view
from gpusnap.restore.restorer import Restorer, Verify
from gpusnap.save.lifecycle import Lifecycle
from gpusnap.save.memory_tier import KEEP as MEMORY_KEEP
from gpusnap.save.memory_tier import MemoryTierChoice, choose_memory_tier
from gpusnap.save.planner import CapturePlanner
from gpusnap.save.saves import Saves
from gpusnap.save.tiers import Tiers, durable_identity, info_from_manifest
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.repository import Repository

__all__ = ["Checkpointer", "info_from_manifest", "resolve_checkpoint"]


class Checkpointer:
    """Checkpoints and restores an ``app_state`` mapping under ``root``.

    ``root`` is a local directory (created on first save) or an fsspec URL such as
    ``memory://ckpt`` or ``s3://bucket/run`` (``storage_options`` go to fsspec).

    >>> import torch, gpusnap
    >>> model = torch.nn.Linear(4, 2)
    >>> app_state = {"model": model, "step": 3}
    >>> with gpusnap.Checkpointer("memory://doctest-ckpt", keep_last=2) as ckpt:
    ...     info = ckpt.save(app_state, tag="first").wait()
    ...     app_state["step"] = 4
    ...     _ = ckpt.restore(app_state)
    >>> app_state["step"]
    3

    With ``fast_root`` (a local path in host memory, such as ``/dev/shm/run1``) saves commit
    to a *fast tier* there (no host copy or hash: docs/tiers.md), which survives the process
    but not the machine; every ``promote_every``-th committed save (and any saved with
    ``promote=True``) is then copied in the background to ``root``, the durable tier.
    ``fast_keep_last`` (default 2) is the fast tier's retention, ``keep_last`` the root's.
    ``list()``, ``latest()`` and ``restore()`` consider both tiers.

    When ``torch.distributed`` is initialized, the Checkpointer is *collective* over
    ``process_group`` (default: the world; ``False``: per process): every rank calls
    ``save()`` at the same step and ``restore()`` together, and a checkpoint is listed once
    every rank's part is durable (docs/distributed.md).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        config: Config | None = None,
        allow_pickle: bool = False,
        storage_options: dict[str, Any] | None = None,
        fast_root: str | os.PathLike[str] | None = None,
        fast_keep_last: int | None = None,
        promote_every: int | None = None,
        process_group: Any = None,
    ) -> None:
        for name, value in (("keep_last", keep_last), ("fast_keep_last", fast_keep_last), ("promote_every", promote_every)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        self.root = os.fspath(root)
        self.fast_root = None if fast_root is None else os.fspath(fast_root)
        self.keep_last = keep_last
        self.config = config = config if config is not None else Config.from_env()
        group = collective_group(process_group)
        self._collective = None if group is None else Collective(self.root, group, config, storage_options)
        if self.fast_root is None:  # the default path: a memory tier of its own, unless refused
            self._memory = choose_memory_tier(self.root, durable_identity(self.root), config,
                                              collective=self._collective is not None)
        else:
            self._memory = MemoryTierChoice(None, "an explicit fast_root")
        tier_root = self.fast_root if self.fast_root is not None else self._memory.path
        if (self.fast_root is None and not self._memory.saves_here and not self._memory.refused
                and (fast_keep_last is not None or promote_every is not None)):
            raise ValueError(f"fast_keep_last and promote_every need a fast_root or the memory tier ({self._memory.why_not})")
        default_keep = 2 if self.fast_root is not None else MEMORY_KEEP
        self.fast_keep_last = fast_keep_last if fast_keep_last is not None else default_keep
        # the memory tier promotes every save unless told otherwise; an explicit fast_root only when told
        memory_tier = self.fast_root is None and tier_root is not None
        self.promote_every = 1 if promote_every is None and memory_tier else promote_every
        if tier_root is not None:
            if config.fast_slab_bytes <= config.piece_bytes():
                raise ValueError(f"Config.fast_slab_bytes ({config.fast_slab_bytes}) must be larger than one "
                                 f"copy piece ({config.piece_bytes()} bytes)")
            if os.path.abspath(tier_root) == os.path.abspath(self.root):
                raise ValueError("fast_root must be a directory of its own, not the Checkpointer's root")
        self.allow_pickle = allow_pickle
        if self._collective is not None and self.fast_root is not None:
            raise ValueError("a collective Checkpointer has no fast tier yet: leave out fast_root, or pass "
                             "process_group=False for per-process checkpoints")
        planner = CapturePlanner(config)
        self._tiers = Tiers(self.root, tier_root, keep_last=keep_last, fast_keep_last=self.fast_keep_last,
                            promote_every=self.promote_every, config=config, storage_options=storage_options,
                            collective=self._collective, on_new_fast=planner.history.forget_previous,
                            memory=self._memory)
        self._saves = Saves(config, planner, self._tiers, allow_pickle=allow_pickle)
        self._restorer = Restorer(
            io_threads=config.io_threads,
            staging_bytes=config.staging_bytes,
            piece_bytes=config.restore_piece_bytes,
            verify_on_device={"auto": None, "on": True, "off": False}[config.restore_verify_on_device],
            scratch_slots=config.restore_scratch_slots,
            device_check_min_bytes=config.device_check_min_bytes,
            reader_processes=config.restore_reader_processes,
            direct_copies=config.restore_direct_copies,
            from_server=config.restore_from_server,
            server_socket=config.restore_server_socket,
        )
        self._life = self._saves.lifecycle = Lifecycle(self._saves, self._restorer, self._collective)
        exit_hooks.track(self._saves, sigterm_grace_s=config.sigterm_grace_s)  # (kept alive by pending work)

    # -- save -----------------------------------------------------------------------------
    def save(
        self, app_state: MutableMapping[str, Any], *, tag: str | None = None, blocking: bool = False,
        promote: bool = False,
    ) -> PendingSave:
        """Checkpoint ``app_state`` as it is now; returns at once unless ``blocking``.

        The checkpoint equals the state at this call (work already enqueued on the current
        CUDA stream counts as before it). ``pending.wait()`` returns the committed
        :class:`CheckpointInfo` or raises the error that stopped the save.

        An earlier save's failure is not raised here (this save may well succeed): the next
        :meth:`wait`, :meth:`close` or ``with``-block exit raises it (see :class:`PendingSave`).

        With a ``fast_root`` the save commits to the fast tier; ``promote=True`` also copies
        it to the durable root afterwards, whatever ``promote_every`` says.
        """
        self._life.check_open()
        if self._collective is None:
            self._check_save(tag, promote)
            return self._saves.save(app_state, tag, blocking, promote=promote)
        agreeing = time.perf_counter()
        _seq, checkpoint_id = self._collective.next_save()  # the same id on every rank: no message
        try:
            self._check_save(tag, promote)  # (tags of collective saves live in the global manifests)
            coordinated = (checkpoint_id, time.perf_counter() - agreeing)  # (the stall counts it)
            return self._saves.save(app_state, tag, blocking, promote=promote, coordinated=coordinated)
        except BaseException as exc:  # the other ranks must not wait for this rank's part
            self._collective.fail(checkpoint_id, exc)
            raise

    def prepare(
        self, app_state: Mapping[str, Any] | None = None, *, nbytes: int | None = None, wait: bool = False
    ) -> int:
        """Make ready now what the first :meth:`save` would otherwise make while it runs;
        returns the bytes of memory set aside. Optional: call it during set-up, once the
        state exists at its full size (an optimizer's state appears at its first step, so
        after that step, or pass ``nbytes``).

        With a ``fast_root`` it sets aside page-locked slabs for ``fast_keep_last + 1``
        checkpoints of ``app_state``'s size (or of ``nbytes``) and makes them on a background
        thread at the lowest priority (``wait=True`` returns once they are made); without
        one it grows the pinned staging a save of CUDA state copies through, on this thread.
        Either way, ``wait=True`` also waits for the save kernels to load. Making the memory
        costs the program ~70 ms per GiB whenever it happens: here, rather than
        in the first checkpoint's window.

        >>> ckpt = gpusnap.Checkpointer("runs/x", fast_root="/dev/shm/x")  # doctest: +SKIP
        >>> train_one_step(); ckpt.prepare(app_state, wait=True)            # doctest: +SKIP
        """
        self._life.check_open()
        if (app_state is None) == (nbytes is None):
            raise ValueError("prepare() takes app_state or nbytes (one of them)")
        return self._saves.prepare(app_state, nbytes, wait)

    def _check_save(self, tag: str | None, promote: bool) -> None:
        """save()'s arguments. A tag names one checkpoint: refuse one that a committed
        checkpoint or a save still pending here carries (the commit checks again, under the
        writer lease)."""
        if tag is not None and (not isinstance(tag, str) or not tag or "/" in tag):
            raise ValueError(f"tag must be a non-empty string without '/', got {tag!r}")
        if promote and self._tiers.fast_root is None:
            raise ValueError("promote=True needs a fast_root or the memory tier (without either every save is durable)")
        if tag is None:
            return
        pending = self._saves.pending_with_tag(tag)
        if pending is not None:
            raise CheckpointError(f"tag {tag!r} is taken by checkpoint {pending}, still being saved; a tag names "
                                  "one checkpoint: pick another tag")
        owner = self._tiers.tag_owner(tag)
        if owner is not None:
            raise CheckpointError(f"tag {tag!r} already names checkpoint {owner} in {self.root}; a tag names one "
                                  "checkpoint: pick another tag")

    # -- waiting, listing -----------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> list[CheckpointInfo]:
        """Wait for every pending save; returns the infos of those that committed.

        Then raises the error of any save (pending or earlier) that failed and whose error
        nothing has observed yet (once; see :class:`PendingSave`), else ``TimeoutError`` if
        ``timeout`` seconds passed first. A save whose retry is due on another thread that is
        not waiting in gpusnap fails at once (docs/capture.md) rather than being waited for.
        """
        self._life.check_process()
        return self._saves.wait_all(timeout)

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints of both tiers, oldest first (empty when nothing was saved
        yet). A checkpoint in both (promoted) lists once, as ``tier="durable"``."""
        return self._tiers.infos()

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint, or None (a WARNING names any newer manifest that
        cannot be read)."""
        infos = self.list()
        return infos[-1] if infos else None

    def delete(self, checkpoint: str) -> None:
        """Delete one committed checkpoint (an id or a tag) from each tier that holds it, and
        free the data no other checkpoint shares (as retention does). A save still pending is
        refused (wait for it first); an unknown one is a CheckpointNotFoundError. Trainer
        plug-ins delete what their framework's own retention drops (``ModelCheckpoint``'s top k).

        >>> ckpt.delete("step-100")   # doctest: +SKIP
        """
        self._life.check_open()
        if not isinstance(checkpoint, str) or not checkpoint:
            raise ValueError(f"checkpoint must be an id or a tag, got {checkpoint!r}")
        if self._collective is not None:  # (it would remove this rank's part, not the checkpoint)
            raise CheckpointError("delete() of one checkpoint is per process only, not yet collective: "
                                  "keep_last retains a collective Checkpointer's checkpoints, or run "
                                  "`gpusnap gc ROOT --keep-last N`")
        busy = self._saves.pending_named(checkpoint)
        if busy is not None:
            raise CheckpointError(f"checkpoint {busy} is still being saved: wait for it before deleting it")
        self._restorer.settle()  # a lazy restore still loading reads the packs the delete frees
        self._tiers.delete(checkpoint)

    # -- restore --------------------------------------------------------------------------
    def restore(
        self,
        app_state: MutableMapping[str, Any],
        checkpoint: str | None = None,
        *,
        lazy: bool = False,
        verify: Verify = "auto",
        strict: bool = True,
    ) -> RestoreHandle:
        """Restore ``app_state`` in place from ``checkpoint`` (an id, a tag, or None: latest).

        Tensors are overwritten in place (data pointers unchanged, so CUDA graphs captured
        earlier stay valid), Stateful values get ``load_state_dict``, plain values are replaced
        in the mapping. Every check runs before any byte is written
        (:class:`~gpusnap.RestoreMismatchError`).

        ``lazy=True`` returns once plain values and Stateful objects are back; tensors load in
        the background, in the order the program touched them when the checkpoint was taken,
        and an op on this thread that touches one not yet loaded waits for exactly that one.
        ``handle.wait()`` waits for all. See docs/restore.md for threads and guarantees.

        ``verify``: ``"upfront"`` checks every chunk before writing any byte (a corrupt
        checkpoint leaves the targets untouched; holds it in host memory); ``"stream"`` checks
        each chunk before its bytes are copied, pipelined (on corruption the error names what
        was already written); ``"off"`` skips the hashes; ``"auto"``: upfront up to 256 MiB,
        else stream. Both raise :class:`~gpusnap.IntegrityError` naming the tensor.

        ``strict=False`` restores only the keys both sides have and reports the rest as dotted
        paths: ``handle.stats["missing"]`` (in ``app_state``, not in the checkpoint) and
        ``handle.stats["unexpected"]`` (in the checkpoint, not in ``app_state``). Keys are
        those of app_state's mappings (top level and nested dicts) and of each module's
        ``state_dict()`` (a buffer the model lacks, a parameter the checkpoint lacks, as
        ``load_state_dict(strict=False)`` reports them); a key names its whole subtree
        (``"optim"``), and a Stateful value's own state (an optimizer's) is restored whole or
        not at all. Shapes and dtypes of shared keys are still checked before any byte is
        written, and no chunk that only skipped keys use is read. ``strict=True`` (default):
        any such key is a :class:`~gpusnap.RestoreMismatchError`.

        >>> h = ckpt.restore({"model": model}, strict=False)  # a training checkpoint  # doctest: +SKIP
        >>> h.stats["unexpected"]                             # doctest: +SKIP
        ['optim', 'step']
        >>> h = ckpt.restore(app_state, lazy=True)   # doctest: +SKIP
        >>> loss = model(batch)                       # waits only for what it touches  # doctest: +SKIP
        """
        self._life.check_open()
        self._restorer.settle()  # one restore at a time: a lazy one still loading finishes first
        self.wait()  # a restore of "latest" must see this process's own pending saves (and
        # raises one that failed unobserved: resuming must not skip it without a word)
        self._saves.reap()
        started = time.perf_counter()
        if self._collective is not None:
            return collective_restore(self._collective, self._restorer, app_state, checkpoint,
                                      allow_pickle=self.allow_pickle, lazy=lazy, verify=verify, strict=strict,
                                      started=started)
        repo, manifest, skipped = self._tiers.resolve(checkpoint)  # "latest" must not fall back silently
        repo.warn_unreadable(skipped, f"restore() used the older checkpoint {manifest.id} instead")
        if manifest.ranks:  # a distributed checkpoint, restored by one process (docs/distributed.md)
            repo, manifest = rank_view(repo, manifest, rank=0, world_size=1)
        handle = self._restorer.restore(
            repo, manifest, app_state, allow_pickle=self.allow_pickle, lazy=lazy, verify=verify, started=started,
            strict=strict,
        )
        handle.stats["skipped_newer"] = [{"id": u.id, "reason": u.reason} for u in skipped]
        return handle

    # -- life cycle -----------------------------------------------------------------------
    def close(self) -> None:
        """Wait for pending saves, release threads; then raise the error of any save that
        failed and whose error nothing has observed yet (once; see :class:`PendingSave`).
        A second call (from any thread) waits until the first has finished."""
        self._life.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        """close(); when the block itself raised, its exception is never replaced: the
        failed saves nothing observed are named in notes on it (and count as observed)."""
        if exc is None or self._life.in_child():
            self.close()
            return
        self._life.shut_down()
        self._saves.unobserved.note_on(exc, "while this exception left the Checkpointer's with block")

    def __repr__(self) -> str:
        return f"Checkpointer({self.root!r}, keep_last={self.keep_last})"


def resolve_checkpoint(ckpt: Checkpointer, checkpoint: str | None) -> tuple[Repository, Manifest, list[Any]]:
    """Where ``checkpoint`` (id, tag, None: the newest across tiers) of ``ckpt`` is read from,
    its manifest, and the unreadable newer manifests skipped: for gpusnap's own entry points
    that restore through a Checkpointer (``gpusnap.cold_start``)."""
    return ckpt._tiers.resolve(checkpoint)
