"""Which checkpoints a restore server holds: the newest ``keep`` committed ones of its root
that load and check.

``refresh()`` lists the root (cheap: the manifests' directory; committed manifests are
cached) and, for each of the newest ``keep`` not held yet, newest first, reads it into
host memory (``held.load_checkpoint``), then drops what is no longer among them. A request
that is copying from a dropped checkpoint keeps it alive until it is done (a reference). A
checkpoint that fails to load (corrupt, or too large for the memory available) is
remembered and not tried again by the periodic refresh, only by an explicit one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpusnap.config import Config
from gpusnap.errors import CheckpointError, CheckpointNotFoundError
from gpusnap.serving.cuda_runtime import Runtime
from gpusnap.serving.held import HeldCheckpoint, layout, load_checkpoint
from gpusnap.storage.manifest import Manifest
from gpusnap.storage.repository import Repository

__all__ = ["Holdings", "available_memory"]

MEMORY_SHARE = 0.9  # of the memory available, at most, for one checkpoint's load


def available_memory() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class Holdings:
    def __init__(self, root: str, *, keep: int, runtime: Runtime | None, config: Config | None,
                 on_event: Callable[[dict[str, Any]], None], threads: int) -> None:
        self.root = root
        self.keep = keep
        self.runtime = runtime
        self.config = config
        self.on_event = on_event
        self._repo: Repository | None = None
        self._held: dict[str, HeldCheckpoint] = {}
        self._failed: dict[str, str] = {}  # id -> why it is not held
        self._waiting = False  # said that the root does not exist yet
        self._lock = threading.Lock()  # _held
        self._refreshing = threading.Lock()  # one refresh at a time
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="gpusnap-serve-load")

    def get(self, checkpoint_id: str) -> HeldCheckpoint | None:
        with self._lock:
            return self._held.get(checkpoint_id)

    def digests(self) -> dict[str, str]:
        with self._lock:
            return {cid: h.digest for cid, h in self._held.items()}

    def status(self) -> dict[str, Any]:
        with self._lock:
            held = [{"id": h.id, "digest": h.digest, "bytes": h.nbytes, "pinned": h.pinned, "load_s": h.load_s}
                    for h in self._held.values()]
        return {"held": held, "failed": dict(self._failed)}

    def refresh(self, *, retry_failed: bool = False) -> None:
        """Hold the newest ``keep`` checkpoints (see the module docstring)."""
        with self._refreshing:
            repo = self._repository()
            if repo is None:
                return
            if retry_failed:
                self._failed.clear()
            wanted = [m for m in repo.list() if m.id not in self._failed][-self.keep :]
            keep_ids = {m.id for m in wanted}
            for manifest in reversed(wanted):  # newest first: the one a fresh process asks for
                if self.get(manifest.id) is None:
                    self._load(repo, manifest, keep_ids)
            self._drop_all_but(keep_ids)

    def _repository(self) -> Repository | None:
        if self._repo is None:
            try:
                self._repo = Repository.open(self.root, config=self.config)
            except CheckpointNotFoundError as exc:
                if not self._waiting:  # (nothing saved yet: every refresh looks again)
                    self._waiting = True
                    self.on_event({"event": "waiting", "why": " ".join(str(exc).split())})
                return None
        return self._repo

    def _load(self, repo: Repository, manifest: Manifest, keep_ids: set[str]) -> None:
        need = layout(manifest)[1]
        if not self._room_for(need, keep_ids):
            self._fail(manifest.id, f"needs {need} bytes of host memory, {available_memory()} are available")
            return
        if self.runtime is not None:
            self.runtime.bind()  # page-locked for the server's device (per-thread current device)
        try:
            held = load_checkpoint(repo, manifest, pinned=self.runtime is not None, pool=self._pool)
        except (CheckpointError, OSError) as exc:
            self._fail(manifest.id, " ".join(str(exc).split()))
            return
        with self._lock:
            self._held[held.id] = held
        self.on_event({"event": "held", "id": held.id, "bytes": held.nbytes, "pinned": held.pinned,
                       "load_s": round(held.load_s, 3)})

    def _room_for(self, need: int, keep_ids: set[str]) -> bool:
        """Whether ``need`` bytes fit; drops held checkpoints that are leaving anyway first
        when they would not (clients then read files until the new one is held)."""
        free = available_memory()
        if free is None or need <= free * MEMORY_SHARE:
            return True
        self._drop_all_but(keep_ids)
        free = available_memory()
        return free is None or need <= free * MEMORY_SHARE

    def _drop_all_but(self, keep_ids: set[str]) -> None:
        with self._lock:
            dropped = [cid for cid in self._held if cid not in keep_ids]
            for cid in dropped:
                del self._held[cid]
        for cid in dropped:
            self.on_event({"event": "dropped", "id": cid})

    def _fail(self, checkpoint_id: str, why: str) -> None:
        self._failed[checkpoint_id] = why
        self.on_event({"event": "failed", "id": checkpoint_id, "why": why})

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            self._held.clear()
