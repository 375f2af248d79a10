"""Where checkpoints live: manifests, content-addressed packs, the repository and its backends,
and the fast tier (checkpoints in host memory: ``storage.fast_tier``).

The durable side (manifests, packs, the repository, the backends) moves bytes and JSON: it
needs no GPU and can point at any fsspec filesystem. The fast tier maps its slabs as torch
tensors (the copy engine writes into them), so importing this package imports torch.

Capture hands its result to storage through the sinks in ``storage.sink``: the write
transactions that :meth:`Repository.begin_write` returns.
"""

from gpusnap.storage.chunk_names import device_name
from gpusnap.storage.chunk_reads import CHECK_SLICE_BYTES
from gpusnap.storage.host_bytes_hash import hash_host_bytes
from gpusnap.storage.backend import Backend, BackendLock, LocalBackend, WriteHandle, open_backend
from gpusnap.storage.fsspec_backend import FsspecBackend
from gpusnap.storage.manifest import Manifest, StorageEntry
from gpusnap.storage.pack import PackEntry, PackIndex, PackWriter, read_pack_index
from gpusnap.storage.repository import GcReport, Repository, VerifyReport, WriteTxn
from gpusnap.storage.sink import ChunkSink, SlabSink, fast_room_needed
from gpusnap.storage.fast_tier import FastTier  # (registers itself: Repository.open returns one for a fast root)
from gpusnap.storage.ranks import RankedRepository  # (likewise, for a root of distributed checkpoints)
from gpusnap.storage.unreadable import UnreadableManifest

__all__ = [
    "Backend",
    "BackendLock",
    "ChunkSink",
    "FastTier",
    "FsspecBackend",
    "GcReport",
    "LocalBackend",
    "Manifest",
    "PackEntry",
    "PackIndex",
    "PackWriter",
    "RankedRepository",
    "Repository",
    "SlabSink",
    "StorageEntry",
    "UnreadableManifest",
    "VerifyReport",
    "WriteHandle",
    "CHECK_SLICE_BYTES",
    "device_name",
    "hash_host_bytes",
    "WriteTxn",
    "fast_room_needed",
    "open_backend",
    "read_pack_index",
]
