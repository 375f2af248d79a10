"""Where one request's bytes go, opened in the server: the client's device allocations over
CUDA IPC, or shared memory it passed.

Every range is checked against its destination's size before anything is copied into it, so
a wrong request is refused rather than written past the client's memory (on a device that
would leave the server's CUDA context broken for every later client). A client's shared
memory must be sealed against shrinking (``F_SEAL_SHRINK``): a file cut short under the
server's copy would kill the server with SIGBUS.

Call order, on one thread: ``Destinations(specs, fds, runtime)`` -> ``check`` every range ->
``copy`` each (a device allocation is opened at its first copy, so opening the next overlaps
the copies already queued) -> ``wait()`` (every copy completed) -> ``close()`` (always; it
waits first, so no copy still runs once the client hears back).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
from typing import Any

from gpusnap.host_map import MappedMemory
from gpusnap.serving.cuda_runtime import Runtime, Stream

__all__ = ["DestError", "Destinations"]


class DestError(ValueError):
    """A request names a destination the server cannot use; the reply says why."""


class Destinations:
    def __init__(self, specs: Any, fds: list[int], runtime: Runtime | None) -> None:
        if not isinstance(specs, list):
            raise DestError("dests must be a list")
        self.runtime = runtime
        self.sizes: list[int] = []
        self.kinds: list[str] = []
        self._handles: dict[int, bytes] = {}  # dest -> IPC handle (cuda)
        self._bases: dict[int, int] = {}  # dest -> its address here, once opened
        self._opened: list[bytes] = []
        self._maps: dict[int, MappedMemory] = {}
        self._stream: Stream | None = None
        self._fds = fds
        for k, spec in enumerate(specs):
            if not isinstance(spec, dict) or not isinstance(spec.get("size"), int) or spec["size"] < 0:
                raise DestError(f"destination {k} is malformed")
            self.sizes.append(spec["size"])
            self.kinds.append(kind := spec.get("kind"))
            if kind == "cuda":
                if runtime is None:
                    raise DestError("this server holds checkpoints for the host only (started without a GPU)")
                try:
                    self._handles[k] = bytes.fromhex(spec["handle"])
                except (KeyError, TypeError, ValueError):
                    raise DestError(f"destination {k}: no IPC handle") from None
            elif kind == "fd":
                self._maps[k] = self._map(k, spec)
            else:
                raise DestError(f"destination {k} is of kind {kind!r}")

    def _map(self, k: int, spec: dict[str, Any]) -> MappedMemory:
        index = spec.get("fd")
        if not isinstance(index, int) or not 0 <= index < len(self._fds):
            raise DestError(f"destination {k} names descriptor {index!r}; {len(self._fds)} came")
        fd = os.dup(self._fds[index])  # (MappedMemory owns and closes its own)
        try:
            if os.fstat(fd).st_size < spec["size"]:
                raise DestError(f"destination {k}: its file is smaller than {spec['size']} bytes")
            if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
                raise DestError(f"destination {k}: shared memory must be sealed against shrinking")
        except OSError as exc:
            os.close(fd)
            raise DestError(f"destination {k}: not sealed shared memory ({exc})") from None
        except BaseException:
            os.close(fd)
            raise
        return MappedMemory(fd, max(spec["size"], 1), pinned=False, populate=False)

    def check(self, k: Any, offset: Any, length: Any) -> None:
        if not (type(k) is int and type(offset) is int and type(length) is int and 0 <= k < len(self.sizes)):
            raise DestError(f"a copy names destination {k!r} at {offset!r} for {length!r} bytes")
        if offset < 0 or length < 0 or offset + length > self.sizes[k]:
            raise DestError(f"bytes [{offset}, {offset + length}) lie outside destination {k} ({self.sizes[k]} bytes)")

    def copy(self, k: int, offset: int, src: int, length: int) -> None:
        """Queue (device) or do (host) the copy of ``length`` bytes at host address ``src``."""
        if self.kinds[k] == "fd":
            ctypes.memmove(self._maps[k].address + offset, src, length)
            return
        stream = self._device_stream()  # (first: it makes the device current for the open)
        stream.copy(self._base(k) + offset, src, length)

    def _device_stream(self) -> Stream:
        if self._stream is None:
            assert self.runtime is not None
            self.runtime.bind()
            self._stream = self.runtime.stream()
        return self._stream

    def _base(self, k: int) -> int:
        base = self._bases.get(k)
        if base is None:
            assert self.runtime is not None
            handle = self._handles[k]
            base, size = self.runtime.open(handle)
            self._opened.append(handle)
            if size is not None and size < self.sizes[k]:
                raise DestError(f"destination {k} is an allocation of {size} bytes, not {self.sizes[k]}")
            self._bases[k] = base
        return base

    @property
    def device_bytes(self) -> int:
        return sum(s for s, kind in zip(self.sizes, self.kinds) if kind == "cuda")

    def wait(self) -> None:
        """Until every copy queued has completed (raises ``CudaError``)."""
        if self._stream is not None:
            self._stream.wait()

    def close(self) -> None:
        """Wait for the copies (never unmap what a copy still writes), then let go of all."""
        try:
            self.wait()
        finally:
            if self._stream is not None:
                self._stream.destroy()
                self._stream = None
            assert self.runtime is not None or not self._opened
            for handle in self._opened:
                self.runtime.close(handle)  # type: ignore[union-attr]
            self._opened = []
            self._maps.clear()  # (unmapped with their last reference)
