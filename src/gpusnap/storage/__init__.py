"""Where checkpoints live: manifests, content-addressed packs, the repository and its backends.

Torch-free on purpose: everything here moves bytes and JSON, so it can be tested, used by the
CLI and pointed at any fsspec filesystem without a GPU stack.
"""

from gpusnap.storage.backend import Backend, BackendLock, LocalBackend, WriteHandle, open_backend
from gpusnap.storage.fsspec_backend import FsspecBackend
from gpusnap.storage.manifest import Manifest, StorageEntry
from gpusnap.storage.pack import PackEntry, PackIndex, PackWriter, read_pack_index
from gpusnap.storage.repository import GcReport, Repository, VerifyReport, WriteTxn
from gpusnap.storage.unreadable import UnreadableManifest

__all__ = [
    "Backend",
    "BackendLock",
    "FsspecBackend",
    "GcReport",
    "LocalBackend",
    "Manifest",
    "PackEntry",
    "PackIndex",
    "PackWriter",
    "Repository",
    "StorageEntry",
    "UnreadableManifest",
    "VerifyReport",
    "WriteHandle",
    "WriteTxn",
    "open_backend",
    "read_pack_index",
]
