"""What a restore asks of the restore server: where each span's bytes go.

A span goes **straight to its targets** when they are byte-contiguous (``RestorePlan.
streamable``) and all on the server's GPU: each target's bytes are a range of a
``cudaMalloc`` allocation (a caching-allocator segment), named by one IPC handle per
allocation however many tensors it holds; the server copies host to device into it. Every
other span (CPU targets, strided layouts, another device, memory without IPC handles such as
``expandable_segments``) **lands** in shared memory this process makes (a sealed ``memfd``);
once the server has answered, :meth:`ServerRequest.apply_landed` applies those spans from it
through the plan, as any restore would.

>>> req = ServerRequest(manifest, plan, server_bus_id="0000:1b:00.0")   # doctest: +SKIP
>>> req.message(cid, digest), req.fds                                    # doctest: +SKIP
"""

from __future__ import annotations

import bisect
import fcntl
import functools
import os
from typing import Any

import torch

from gpusnap.host_map import MappedMemory
from gpusnap.restore.apply_bytes import apply_span
from gpusnap.restore.via_server.cuda_ipc import CudaError, bus_id, mem_handle, segment
from gpusnap.restore.via_server.protocol import ALIGN
from gpusnap.state.plan import RestorePlan
from gpusnap.storage.manifest import Manifest

__all__ = ["ServerRequest"]


@functools.cache
def _bus_id(index: int) -> str:
    return bus_id(index)


class ServerRequest:
    """The destinations and copies for ``manifest``'s spans into ``plan``'s targets, for a
    server whose GPU has PCI bus id ``server_bus_id`` (None: a server without one)."""

    def __init__(self, manifest: Manifest, plan: RestorePlan, *, server_bus_id: str | None) -> None:
        self.plan = plan
        self.dests: list[dict[str, Any]] = []
        self.copies: list[list[int]] = []
        self.direct_spans: list[int] = []  # written by the server into the targets
        self.landed: list[tuple[int, int, int]] = []  # (span, offset in the landing memory, nbytes)
        self.devices: set[torch.device] = set()  # of the direct spans: synchronized before the request
        self.ipc_refused: str | None = None  # why some spans land instead of going direct
        self._segments: list[tuple[int, int, int]] = []  # sorted (base, end, dest)
        self._landing: MappedMemory | None = None
        self.fds: tuple[int, ...] = ()
        at = 0
        for i, entry in enumerate(manifest.storages):
            if entry.nbytes == 0:
                continue
            if not self._direct(i, server_bus_id):
                self.landed.append((i, at, entry.nbytes))
                at += -(-entry.nbytes // ALIGN) * ALIGN
        if self.landed:
            self._make_landing(at)

    @property
    def copy_bytes(self) -> int:
        """Bytes the server copies: each target's, which a span's views may cover more or
        less than once."""
        return sum(c[2] for c in self.copies)

    @property
    def handles(self) -> int:
        """Device allocations named (one IPC handle each)."""
        return sum(d["kind"] == "cuda" for d in self.dests)

    @property
    def direct_bytes(self) -> int:
        """Bytes the server copies straight into targets on its GPU."""
        return sum(c[2] for c in self.copies if self.dests[c[3]]["kind"] == "cuda")

    def _direct(self, index: int, server_bus_id: str | None) -> bool:
        """Queue span ``index``'s copies straight into its targets, if it can go so."""
        devices = self.plan.devices(index)
        if server_bus_id is None or len(devices) != 1 or not self.plan.streamable(index):
            return False
        (device,) = devices
        if device.type != "cuda" or _bus_id(device.index if device.index is not None else 0) != server_bus_id:
            return False
        copies = []
        try:
            with torch.cuda.device(device):  # (the driver's calls need the device's context current)
                for t in self.plan.byte_targets(index):
                    k, offset = self._dest_of(t.dst.data_ptr(), t.stop - t.start)
                    copies.append([index, t.start, t.stop - t.start, k, offset])
        except CudaError as exc:
            self.ipc_refused = str(exc)
            return False
        self.copies += copies
        self.direct_spans.append(index)
        self.devices.add(device)
        return True

    def _dest_of(self, ptr: int, nbytes: int) -> tuple[int, int]:
        """The destination (one per allocation) holding ``[ptr, ptr + nbytes)``, and the offset."""
        at = bisect.bisect_right(self._segments, (ptr, float("inf"), 0)) - 1
        if at >= 0 and self._segments[at][0] <= ptr and ptr + nbytes <= self._segments[at][1]:
            base, _, k = self._segments[at]
            return k, ptr - base
        base, size = segment(ptr)
        k = len(self.dests)
        self.dests.append({"kind": "cuda", "handle": mem_handle(base).hex(), "size": size})
        bisect.insort(self._segments, (base, base + size, k))
        return k, ptr - base

    def _make_landing(self, nbytes: int) -> None:
        fd = os.memfd_create("gpusnap-landing", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            # the server refuses memory that could shrink under its copy (a SIGBUS there)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._landing = MappedMemory(os.dup(fd), nbytes, pinned=False, populate=False)
        except BaseException:
            os.close(fd)
            raise
        self.fds = (fd,)
        k = len(self.dests)
        self.dests.append({"kind": "fd", "fd": 0, "size": nbytes})
        self.copies += [[i, 0, n, k, at] for i, at, n in self.landed]

    def message(self, checkpoint_id: str, digest: str) -> dict[str, Any]:
        return {"op": "restore", "id": checkpoint_id, "digest": digest, "dests": self.dests, "copies": self.copies}

    def sent(self) -> None:
        """The descriptors went with the request: close ours (the mapping stays)."""
        for fd in self.fds:
            os.close(fd)
        self.fds = ()

    def apply_landed(self) -> None:
        """Apply the spans that landed in shared memory (after the server's "ok")."""
        if self._landing is None:
            return
        memory = self._landing.tensor
        for index, at, nbytes in self.landed:
            apply_span(self.plan, index, memory[at : at + nbytes])

    def mark_written(self) -> None:
        """Count the server's writes as in-place changes of the targets, as an eager restore's
        own copies are (autograd's version counters; inference tensors have none)."""
        for index in self.direct_spans:
            for t in self.plan.targets(index):
                if not t.is_inference():
                    torch.autograd.graph.increment_version(t)

    def close(self) -> None:
        self.sent()
        self._landing = None
