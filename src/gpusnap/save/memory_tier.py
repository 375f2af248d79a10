"""The default path's memory tier: where ``Checkpointer(root)`` captures before ``root``.

A Checkpointer given only a root captures each checkpoint into a fast tier of its own in host
memory (``Config.memory_tier_dir``, /dev/shm: page-locked once, reused by every save) and
promotes every save to ``root`` in the background. The tier's directory is derived from the
root, ``<dir>/gpusnap-<uid>/<hash of the root>``, so a process that crashed leaves its newest
checkpoints where the next Checkpointer of that root finds them (``list()``/``restore()`` read
them, and the newest is made durable); a clean ``close()`` or exit removes it once every
checkpoint it holds that is newer than the root's newest is durable.

Where that memory is refused (no such directory, not this user's, too small for the state) the
Checkpointer writes each save to ``root`` directly, as ``Config.memory_tier="off"`` does, with
a WARNING once and ``stats["memory_tier"]`` saying why.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass

from gpusnap.config import Config
from gpusnap.storage.private_dir import ensure_private_dir

__all__ = ["KEEP", "MemoryTierChoice", "durable_identity", "choose_memory_tier", "memory_tier_path", "memory_tier_usage", "refused"]

log = logging.getLogger("gpusnap")

# checkpoints the memory tier keeps: the newest (restorable at once), while one more may be
# held by its promotion and one more is being captured: 3 x the state at most
KEEP = 1


@dataclass(frozen=True)
class MemoryTierChoice:
    """``path``: the memory tier's directory, or None; ``why_not``: why saves do not go there
    (None: they do). A path with a reason is a tier an earlier process left, which is read
    (``list()``, ``restore()``) and whose newest checkpoint is made durable, while saves go to
    the root directly."""

    path: str | None
    why_not: str | None = None
    refused: bool = False  # wanted, but this machine refused it (not the caller's choice)

    @property
    def saves_here(self) -> bool:
        return self.path is not None and self.why_not is None

    @property
    def note(self) -> str:
        """What ``stats["memory_tier"]`` says."""
        if self.saves_here:
            return f"on: {self.path}"
        return f"off: {self.why_not}" if self.why_not else "off"


def durable_identity(root: str) -> str:
    """How a fast root records the durable root it belongs to (a local one by its real path)."""
    local = root.removeprefix("file://")
    return root if "://" in local else os.path.realpath(local)


def memory_tier_path(base: str, identity: str) -> str:
    """``<base>/gpusnap-<uid>/<16 hex digits of the root's identity>``.

    >>> memory_tier_path("/dev/shm", "/runs/a").startswith(f"/dev/shm/gpusnap-{os.geteuid()}/")
    True
    """
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return os.path.join(base, f"gpusnap-{os.geteuid()}", digest)


def choose_memory_tier(root: str, durable_identity: str, config: Config, *, collective: bool) -> MemoryTierChoice:
    """The memory tier a Checkpointer of ``root`` with no ``fast_root`` uses; a refusal is
    logged (WARNING) here, once per Checkpointer."""
    if root.startswith("memory://"):  # (the root is this process's memory already)
        return MemoryTierChoice(None, "the root is in memory")
    if collective:
        return MemoryTierChoice(None, "a collective Checkpointer writes each rank's part to the root")
    off = config.memory_tier_mode() == "off"
    base = _base(config)
    try:
        if not os.path.isdir(base):
            raise FileNotFoundError(f"{base} is not a directory")
        ensure_private_dir(os.path.join(base, f"gpusnap-{os.geteuid()}"), what="the memory tier's directory",
                           elsewhere="set Config.memory_tier_dir (GPUSNAP_MEMORY_TIER_DIR) to a tmpfs of yours",
                           create=not off)
    except OSError as exc:
        if off:
            return MemoryTierChoice(None, "Config.memory_tier='off'")
        return refused(f"no host memory tier under {base}: {exc}")
    path = memory_tier_path(base, durable_identity)
    if off:  # (one an earlier process left is still read and made durable)
        return MemoryTierChoice(path if os.path.isdir(path) else None, "Config.memory_tier='off'")
    return MemoryTierChoice(path)


def _base(config: Config) -> str:
    return config.memory_tier_dir or os.environ.get("GPUSNAP_MEMORY_TIER_DIR") or "/dev/shm"


def refused(why: str, path: str | None = None) -> MemoryTierChoice:
    """Saves go to the root because the machine refused the memory tier, logged (WARNING);
    ``path``: a tier that exists all the same (read, and its newest made durable)."""
    log.warning("gpusnap: %s; each save is written to the root directly (slower, and the host hashes every byte); "
                "Config.memory_tier='off' turns the memory tier off without this warning", why)
    return MemoryTierChoice(path, why, refused=True)


def memory_tier_usage(root: str, config: Config) -> tuple[str, int] | None:
    """``(path, bytes)`` of the memory tier a default Checkpointer of ``root`` holds now (its
    slab files: host memory), or None when there is none (``gpusnap du`` reports it)."""
    path = memory_tier_path(_base(config), durable_identity(root))
    if not os.path.isdir(path):
        return None
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_blocks * 512
            except OSError:
                continue
    return path, total
