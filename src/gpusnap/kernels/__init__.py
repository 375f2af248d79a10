"""Kernels: the chunk digest that names stored chunks (``hashing``), the fast device hash of
each chunk that validation, incremental saves and restores check (``chunk_hash``,
``chunk_hash_many``: Triton on CUDA, the same function in torch elsewhere), and the gather
copy of many spans in one launch (``gather_copy``)."""

from gpusnap.kernels.hashing import DIGEST_BYTES, chunk_digest, digest_many

__all__ = ["DIGEST_BYTES", "chunk_digest", "digest_many"]
