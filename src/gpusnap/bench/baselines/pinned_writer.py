"""Stop-the-world copy into pinned host buffers, then one background thread writes them to a
file and fsyncs it: the simplest correct asynchronous checkpoint, and the cost suite's
baseline (its ratios are against this row).

``save()`` waits for the previous write (the buffers are reused: one checkpoint in flight),
synchronizes the device, copies every state tensor into its pinned buffer (allocated once in
``setup``: pinning gigabytes takes seconds, a real program does it once) with
``non_blocking=True``, synchronizes again and returns: the state is captured. The writer
thread then writes one file (an 8-byte header length, a JSON index, the tensors' raw bytes
back to back) to a temporary name, fsyncs it, renames it and fsyncs the directory: durable.
Without CUDA the buffers are ordinary host memory (a CPU smoke test of the same code).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO

import torch

from gpusnap.bench.system import SaveHandle, System, dir_bytes, sync, writer_handle
from gpusnap.bench.verify import compare
from gpusnap.bench.workloads import Workload
from gpusnap.storage.backend import fsync_path

__all__ = ["PinnedWriter", "read_raw", "write_raw"]

_PIECE = 64 << 20  # bytes per write() call: a raw file may write less than asked


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _write_all(f: BinaryIO, data: memoryview) -> None:
    off = 0
    while off < len(data):
        off += f.write(data[off : off + _PIECE]) or 0


def write_raw(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` (host, contiguous) to ``path``: temporary name, fsync, rename, fsync dir."""
    index, offset = [], 0
    for name, t in tensors.items():
        index.append({"name": name, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                      "offset": offset, "nbytes": t.untyped_storage().nbytes()})
        offset += index[-1]["nbytes"]
    header = json.dumps(index).encode()
    tmp = path + ".tmp"
    with open(tmp, "wb", buffering=0) as f:
        _write_all(f, memoryview(len(header).to_bytes(8, "little") + header))
        for t in tensors.values():
            _write_all(f, _raw(t))
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path))


def _timed_write(path: str, tensors: dict[str, torch.Tensor]) -> float:
    write_raw(path, tensors)
    return time.perf_counter()  # the durable moment, on the writer thread


def read_raw(path: str, into: dict[str, torch.Tensor]) -> None:
    """Copies every tensor of a :func:`write_raw` file into ``into``'s tensors, in place."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        index = json.loads(f.read(size))
        for entry in index:
            buf = torch.empty(entry["nbytes"], dtype=torch.uint8)
            f.readinto(_raw(buf))  # type: ignore[attr-defined]
            value = buf.view(getattr(torch, entry["dtype"])).view(entry["shape"])
            into[entry["name"]].copy_(value)


class PinnedWriter(System):
    key = "pinned_writer"
    label = "pinned copy + writer thread"
    family = "stop-the-world copy"
    measures_throughput = True

    def __init__(self, root: str, *, target: str = "tmpfs") -> None:
        self.target = target
        self.dir = os.path.join(root, self.key)
        self.path = os.path.join(self.dir, "state.bin")
        self._buffers: dict[str, torch.Tensor] = {}
        self._writer: ThreadPoolExecutor | None = None
        self._write: Future[float] | None = None
        self._pinned = False

    def setup(self, wl: Workload) -> None:
        os.makedirs(self.dir, exist_ok=True)
        self._pinned = wl.device.type == "cuda"
        self._buffers = {name: torch.empty(t.shape, dtype=t.dtype, pin_memory=self._pinned)
                         for name, t in wl.tensors().items()}
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="bench-pinned-writer")

    def save(self, wl: Workload, index: int) -> SaveHandle:
        assert self._writer is not None
        started = time.perf_counter()
        if self._write is not None:
            self._write.result()  # the buffers are the previous checkpoint's until it is written
        sync(wl.device)
        for name, t in wl.tensors().items():
            self._buffers[name].copy_(t, non_blocking=True)
        sync(wl.device)
        write = self._writer.submit(_timed_write, self.path, self._buffers)
        self._write = write
        return writer_handle(started, write)

    def verify(self, wl: Workload, target: Workload, index: int, expected: dict[str, torch.Tensor]) -> tuple[bool, str]:
        if self._write is not None:
            self._write.result()
        read_raw(self.path, target.tensors())
        sync(target.device)
        return compare(expected, target.tensors())

    def pinned_bytes(self) -> int | None:
        return sum(b.untyped_storage().nbytes() for b in self._buffers.values()) if self._pinned else 0

    def bytes_on_disk(self) -> int | None:
        return dir_bytes(self.dir) if os.path.isdir(self.dir) else None

    def notes(self) -> list[str]:
        return [] if self._pinned else ["no CUDA: ordinary host buffers, not pinned"]

    def teardown(self) -> None:
        try:
            if self._write is not None:
                self._write.result()
        finally:
            self._write = None
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
            self._buffers = {}
            shutil.rmtree(self.dir, ignore_errors=True)
