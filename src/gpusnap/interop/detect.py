"""What a path to import holds, told from its content (never its name): a safetensors file,
a ``torch.save`` file, a DCP directory or a Hugging Face model directory."""

from __future__ import annotations

import os
import struct

from gpusnap.interop import dcp_format, hf_dir
from gpusnap.interop.errors import FormatError

__all__ = ["KINDS", "identify"]

KINDS = ("safetensors", "torch", "dcp", "huggingface")
_ZIP = b"PK\x03\x04"  # torch.save since 1.6
_PICKLE = 0x80  # the legacy torch.save format opens with a pickle's protocol opcode
_PROTOCOLS = (b"\x02", b"\x03", b"\x04", b"\x05")


def identify(path: str) -> str:
    """One of :data:`KINDS`; FormatError naming ``path`` when it is none of them."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, dcp_format.METADATA)):
            return "dcp"
        if any(os.path.isfile(os.path.join(path, name)) for name in hf_dir.FILES):
            return "huggingface"
        raise FormatError(
            f"{path}: unsupported directory: neither a DCP checkpoint (no {dcp_format.METADATA}) nor a "
            f"Hugging Face model directory (no {', '.join(hf_dir.FILES)})"
        )
    try:
        with open(path, "rb") as f:
            head = f.read(9)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise FormatError(f"{path}: no such file or directory") from None
    except OSError as exc:
        raise FormatError(f"{path}: cannot be read: {exc.strerror or exc}") from exc
    if not head:
        raise FormatError(f"{path}: empty file")
    if head.startswith(_ZIP):
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":  # an 8-byte little-endian header length, then JSON
        (length,) = struct.unpack("<Q", head[:8])
        if length > size - 8:
            raise FormatError(f"{path}: truncated safetensors file: its header says {length} bytes, "
                              f"the file has {size - 8} after the length")
        return "safetensors"
    if head[0] == _PICKLE and head[1:2] in _PROTOCOLS:  # (after safetensors: its length may start so)
        return "torch"
    raise FormatError(f"{path}: unsupported file: not safetensors, not a torch.save file (zip or legacy pickle)")
