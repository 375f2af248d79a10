"""How a durable root names a chunk: by BLAKE2b, or by the device hash its program computed.

A chunk the capture layer or an import stores is named by its BLAKE2b-128 digest (32 hex
digits), computed on the host. A chunk a promotion stores from the memory tier is named
``nh:`` + its device hash (:data:`~gpusnap.storage.manifest.DEVICE_HASH`, 32 hex digits),
which the device computed at the consistent point: the host never hashes those bytes again.

The two are different name spaces, so they never deduplicate against each other. That is the
threat model (docs/guarantees.md): the device hash is 128 bits and catches every accidental
change, but it is not collision-resistant, so bytes from outside the program (an import of
someone's file) keep a BLAKE2b name and can never stand in for a chunk of the program's own
checkpoints. The program's own state is trusted as much as the program, as incremental saves
already trust the device hash to say that a chunk is unchanged.
"""

from __future__ import annotations

import re

__all__ = ["DEVICE_PREFIX", "device_hash_of", "device_name", "is_device_name"]

DEVICE_PREFIX = "nh:"
_DEVICE_NAME = re.compile(r"nh:[0-9a-f]{32}")


def device_name(device_hash: str) -> str:
    """The durable name of a chunk whose device hash is ``device_hash`` (32 hex digits).

    >>> device_name("0" * 32)
    'nh:00000000000000000000000000000000'
    """
    return DEVICE_PREFIX + device_hash


def is_device_name(name: str) -> bool:
    """Whether ``name`` names a chunk by its device hash (else by BLAKE2b)."""
    return name.startswith(DEVICE_PREFIX)


def device_hash_of(name: str) -> str:
    """The device hash a device name carries; ValueError for anything else."""
    if not _DEVICE_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a chunk named by its device hash ('nh:' and 32 lowercase hex digits)")
    return name[len(DEVICE_PREFIX):]
