"""Every tunable knob in one place, with ``GPUSNAP_*`` environment overrides.

>>> from gpusnap.config import Config
>>> Config(chunk_size=1 << 20).chunk_size
1048576
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

__all__ = ["Config", "MiB"]

MiB = 1 << 20
_MAY_BE_ZERO = {"sigterm_grace_s", "cow_budget_bytes", "fast_tier_bytes", "cpu_snapshot_bytes", "eager_cpu_bytes", "eager_device_bytes", "staging_bytes",
                "restore_piece_bytes", "gc_compact_percent"}


def _default_io_threads() -> int:
    """4, or half the usable cores up to 8 on larger machines.

    While the program runs Python, each writer thread waits for the GIL after every chunk's
    hash and write (up to the 5 ms switch interval each time): 4 writers stored a 9.3 GB
    training state at ~1.1 GB/s while it trained (BENCHMARKS.md). More writers
    wait side by side; the number of GIL hand-overs per byte stays the same.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 4
    return max(4, min(8, cores // 2))


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(f"GPUSNAP_{name.upper()}")
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"GPUSNAP_{name.upper()}={raw!r} is not an integer") from None


@dataclass(frozen=True)
class Config:
    """Knobs for a :class:`gpusnap.Checkpointer`.

    Fields left at their defaults can be overridden with environment variables named
    ``GPUSNAP_<FIELD>`` (for example ``GPUSNAP_CHUNK_SIZE=1048576``); explicit arguments win.
    """

    chunk_size: int = field(default=4 * MiB, metadata={"doc": "bytes per chunk (hash, copy, dedup unit)"})
    pack_size: int = field(default=256 * MiB, metadata={"doc": "a pack file is closed past this size"})
    io_threads: int = field(
        default=_default_io_threads(), metadata={"doc": "writer/reader threads for pack files (4, or half the cores up to 8)"}
    )
    staging_bytes: int = field(
        default=0,
        metadata={"doc": "host staging memory at most, pinned for CUDA (0: a quarter of physical RAM); "
                  "grown on demand, kept across saves"},
    )
    copy_piece_bytes: int = field(
        default=32 * MiB, metadata={"doc": "bytes per device-to-host copy (whole chunks)"}
    )
    # One: while a second copy waits behind the first, the copy engine never runs dry, and
    # the program's own small device-to-host copies (a loss read, an optimizer's check) wait
    # behind the whole burst: with two or more pieces in flight, training stood still for the
    # whole capture, and with one it lost nothing (BENCHMARKS.md).
    copy_ahead: int = field(
        default=1, metadata={"doc": "copies in flight per window, at most this many pieces' bytes"}
    )
    max_pending_saves: int = field(default=2, metadata={"doc": "durable writes queued at most"})
    fsync: bool = field(default=True, metadata={"doc": "fsync files and directories on commit"})
    concurrent: bool = field(default=True, metadata={"doc": "save() captures while the program runs"})
    cow_budget_bytes: int = field(
        default=0, metadata={"doc": "copy-on-write shadows at most (0: a quarter of free memory)"}
    )
    eager_cpu_bytes: int = field(
        default=64 * 1024, metadata={"doc": "CPU spans up to this size are copied at save()"}
    )
    validate: bool = field(
        default=True, metadata={"doc": "hash chunks at save() and after their copy; fail on unseen writes"}
    )
    retry_validation: bool = field(
        default=True,
        metadata={"doc": "a save that failed validation is retried once (offenders captured at save()), "
                  "at the next gpusnap call on the saving thread"},
    )
    incremental: bool = field(
        default=True, metadata={"doc": "skip chunks unchanged since this root's latest checkpoint"}
    )
    warm_up_kernels: bool = field(
        default=True,
        metadata={"doc": "a Checkpointer made once CUDA is up loads the save kernels on a side thread "
                  "(else the first save() loads them, which costs it up to seconds)"},
    )
    device_snapshot: bool = field(
        default=True,
        metadata={"doc": "when each device's state fits in the copy-on-write budget (and in half of the "
                  "driver's free memory), copy it device-to-device "
                  "at save() (one batched copy): the program is then not tracked and needs no "
                  "validation hashes; False: track writes and copy-on-write lazily"},
    )
    cpu_snapshot_bytes: int = field(
        default=64 * MiB,
        metadata={"doc": "CPU spans are all copied at save() when they total at most this (a memcpy is "
                  "cheaper than tracking every op); 0: only those within eager_cpu_bytes"},
    )
    eager_device_bytes: int = field(
        default=1 << 20,
        metadata={"doc": "device spans up to this size are copied at save(), all in one batched copy"},
    )
    restore_piece_bytes: int = field(
        default=0, metadata={"doc": "restore: bytes per read run / host region / device copy (0: automatic, "
                             "64 MiB with direct copies, else 32 MiB; 64 MiB restored somewhat faster but "
                             "page-locks twice the host memory at a Checkpointer's first restore)"}
    )
    restore_verify_on_device: str = field(
        default="auto",
        metadata={"doc": "restore: check chunks on the device against the manifest's device hashes "
                  "(auto: CUDA spans of at least device_check_min_bytes; on; off: BLAKE2b on the host)"},
    )
    restore_scratch_slots: int = field(
        default=3, metadata={"doc": "restore: device scratch pieces per device for device-side checks"}
    )
    device_check_min_bytes: int = field(
        default=1 * MiB, metadata={"doc": "restore: smaller spans keep BLAKE2b on the host (auto mode), unless "
                  "batched with larger device-checked ones"}
    )
    restore_reader_processes: str = field(
        default="auto",
        metadata={"doc": "restore: read pack files in reader processes over shared memory, so that "
                  "reading takes no GIL from the copy thread (auto: when a restore has CUDA targets "
                  "and the checkpoint is a local directory on Linux; on: whenever possible; off)"},
    )
    restore_direct_copies: str = field(
        default="off",
        metadata={"doc": "restore: helper processes copy device-checked pieces from the page cache straight "
                  "to the device, page-locking it in place, so the host's CPU copies nothing; they keep "
                  "~2.3 GB of device memory and gained little, hence off by default (auto: CUDA "
                  "targets of at least 1 GiB, a local checkpoint directory on Linux, chunks checked on the "
                  "device; on: also CPU targets whose device check is forced, through shared memory, for "
                  "tests; off)"},
    )
    restore_from_server: str = field(
        default="auto",
        metadata={"doc": "restore: ask the root's restore server (`gpusnap serve ROOT`, docs/serve.md) first, which "
                  "copies from page-locked host memory into the targets (auto: when its socket exists, a RuntimeWarning "
                  "if it then does not serve; on: warn also when no server runs; off); whatever it does not serve "
                  "is restored from files as usual"},
    )
    restore_server_socket: str = field(
        default="", metadata={"doc": "restore: the restore server's socket ('': derived from the root, docs/serve.md)"}
    )
    when_busy: str = field(
        default="wait",
        metadata={"doc": "fast tier: a save that finds no room in the fast tier waits for the saves and promotion "
                  "in flight to make room ('wait'), or is skipped and reported ('skip')"},
    )
    fast_slab_bytes: int = field(
        default=1 << 30,
        metadata={"doc": "fast tier: bytes per slab file (page-locked once per process, reused by every save)"},
    )
    fast_tier_bytes: int = field(
        default=0,
        metadata={"doc": "fast tier: slab bytes at most (0: what a Checkpointer's checkpoints need, "
                  "fast_keep_last + 2 saves of its state; a StorageError when its file system cannot hold that)"},
    )
    memory_tier: str = field(
        default="",
        metadata={"doc": "a Checkpointer given only a root captures into reused host memory under /dev/shm and "
                  "makes each checkpoint durable in the root in the background ('auto'); 'off' writes each save "
                  "to the root directly (what 'auto' falls back to, with a WARNING, where that memory is refused); "
                  "'': $GPUSNAP_MEMORY_TIER, else 'auto'"},
    )
    memory_tier_dir: str = field(
        default="",
        metadata={"doc": "where the default path's host memory lives ('': $GPUSNAP_MEMORY_TIER_DIR, else /dev/shm; "
                  "a tmpfs, where a directory of this user's is made)"},
    )
    promotion_process: str = field(
        default="off",
        metadata={"doc": "promotions (the background writes that make a memory-tier or fast-tier checkpoint "
                  "durable) run in a helper process with a CUDA context of its own, so that their writes and "
                  "device checks take no interpreter lock from the training thread (auto: for a local root "
                  "when the checkpoint has CUDA tensors; on: for any local root; off: on the program's threads; "
                  "a helper that cannot start or dies leaves them to the program's threads, with a WARNING)"},
    )
    direct_writes: str = field(
        default="auto",
        metadata={"doc": "pack files of a local root are written with O_DIRECT, straight from host memory, where "
                  "the file system takes it ('auto'; else buffered), or always buffered ('off')"},
    )
    sigterm_grace_s: int = field(
        default=25,
        metadata={"doc": "on SIGTERM (preemption), seconds to finish pending saves and promotions before the process "
                  "ends with the signal's status, after any handler installed before it (0: gpusnap installs no "
                  "handler); what cannot finish is named on stderr"},
    )
    collective_timeout_s: int = field(
        default=300,
        metadata={"doc": "distributed: how long a rank waits for the other ranks' parts of a save, or for "
                  "rank 0's decision, before the save fails (a rank gone is noticed sooner on a local root)"},
    )
    gc_compact_percent: int = field(
        default=50,
        metadata={"doc": "an explicit gc (`gpusnap gc`, `Repository.gc()`) rewrites the live chunks of a pack into a "
                  "new one, then deletes it, when more than this percentage of its chunk bytes is dead (0: any "
                  "dead byte; 100: never); a Checkpointer's retention never compacts"},
    )
    trace_dir: str = field(
        default="", metadata={"doc": "write a Chrome trace of each capture window here ('' : off)"}
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (bool, str)):
                continue
            least = 0 if f.name in _MAY_BE_ZERO else 1
            if not isinstance(value, int) or value < least:
                raise ValueError(f"Config.{f.name} must be an integer >= {least}, got {value!r}")
        if self.restore_verify_on_device not in ("auto", "on", "off"):
            raise ValueError(
                f"Config.restore_verify_on_device must be 'auto', 'on' or 'off', got {self.restore_verify_on_device!r}"
            )
        if self.restore_reader_processes not in ("auto", "on", "off"):
            raise ValueError(
                f"Config.restore_reader_processes must be 'auto', 'on' or 'off', got {self.restore_reader_processes!r}"
            )
        if self.restore_direct_copies not in ("auto", "on", "off"):
            raise ValueError(
                f"Config.restore_direct_copies must be 'auto', 'on' or 'off', got {self.restore_direct_copies!r}"
            )
        if self.restore_from_server not in ("auto", "on", "off"):
            raise ValueError(f"Config.restore_from_server must be 'auto', 'on' or 'off', got {self.restore_from_server!r}")
        if self.memory_tier not in ("", "auto", "off"):
            raise ValueError(f"Config.memory_tier must be 'auto' or 'off', got {self.memory_tier!r}")
        if self.promotion_process not in ("auto", "on", "off"):
            raise ValueError(f"Config.promotion_process must be 'auto', 'on' or 'off', got {self.promotion_process!r}")
        if self.direct_writes not in ("auto", "off"):
            raise ValueError(f"Config.direct_writes must be 'auto' or 'off', got {self.direct_writes!r}")
        if self.when_busy not in ("wait", "skip"):
            raise ValueError(f"Config.when_busy must be 'wait' or 'skip', got {self.when_busy!r}")
        if self.gc_compact_percent > 100:
            raise ValueError(f"Config.gc_compact_percent must be between 0 and 100, got {self.gc_compact_percent}")
        if self.chunk_size % 512:
            raise ValueError(f"Config.chunk_size must be a multiple of 512, got {self.chunk_size}")
        if self.staging_bytes and self.staging_bytes < self.chunk_size:
            raise ValueError("Config.staging_bytes must hold at least one chunk (or be 0: automatic)")

    @classmethod
    def from_env(cls, **overrides: object) -> Config:
        """Defaults, then ``GPUSNAP_*`` variables, then ``overrides``."""
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            default = f.default
            if isinstance(default, str):
                values[f.name] = os.environ.get(f"GPUSNAP_{f.name.upper()}", default)
            elif isinstance(default, bool):
                raw = os.environ.get(f"GPUSNAP_{f.name.upper()}")
                values[f.name] = default if raw in (None, "") else raw.lower() not in ("0", "false", "no")
            else:
                values[f.name] = _env_int(f.name, default)  # type: ignore[arg-type]
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]

    def memory_tier_mode(self) -> str:
        """``memory_tier``, or where it is '' the environment's (``GPUSNAP_MEMORY_TIER``), else 'auto'."""
        mode = self.memory_tier or os.environ.get("GPUSNAP_MEMORY_TIER") or "auto"
        if mode not in ("auto", "off"):
            raise ValueError(f"GPUSNAP_MEMORY_TIER must be 'auto' or 'off', got {mode!r}")
        return mode

    def staging_capacity(self) -> int:
        """``staging_bytes``, or a quarter of physical RAM when it is 0 (at least one piece)."""
        if self.staging_bytes:
            return self.staging_bytes
        try:
            ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            ram = 4 << 30
        return max(ram // 4 // self.chunk_size * self.chunk_size, self.copy_piece_bytes, self.chunk_size)

    def piece_bytes(self) -> int:
        """Bytes per copy piece: whole chunks, at most the staging capacity."""
        piece = min(self.copy_piece_bytes, self.staging_capacity())
        return max(self.chunk_size, piece // self.chunk_size * self.chunk_size)
