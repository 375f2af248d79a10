"""Hashing kernels: the chunk digest used for content addressing and integrity checks."""

from gpusnap.kernels.hashing import DIGEST_BYTES, chunk_digest, digest_many

__all__ = ["DIGEST_BYTES", "chunk_digest", "digest_many"]
