"""``torch.save`` in a background thread, as many training scripts make their checkpoints
asynchronous.

A thread must not ``torch.save`` the live tensors: the program mutates them meanwhile and
the file would mix steps. So ``save()`` first copies every state tensor to ordinary
(pageable) host memory, ``{k: v.cpu()}``, the usual first idea, allocated afresh each save,
and a background thread then ``torch.save``s that copy to a temporary name, fsyncs,
renames and fsyncs the directory. One checkpoint in flight: a save waits for the previous
write first. The difference from ``pinned_writer`` is the pageable copy each save and
``torch.save``'s serialization.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from gpusnap.bench.system import SaveHandle, System, sync, writer_handle
from gpusnap.bench.verify import compare
from gpusnap.bench.workloads import Workload
from gpusnap.storage.backend import fsync_path

__all__ = ["TorchSaveThread"]


def _save(path: str, snapshot: dict[str, torch.Tensor]) -> float:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(snapshot, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path))
    return time.perf_counter()  # the durable moment, on the writer thread


class TorchSaveThread(System):
    key = "torch_save_thread"
    label = "torch.save in a thread"
    family = "torch.save"
    measures_throughput = True

    def __init__(self, root: str, *, target: str = "tmpfs") -> None:
        self.target = target
        self.dir = os.path.join(root, self.key)
        self.path = os.path.join(self.dir, "state.pt")
        self._writer: ThreadPoolExecutor | None = None
        self._write: Future[float] | None = None

    def setup(self, wl: Workload) -> None:
        os.makedirs(self.dir, exist_ok=True)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="bench-torch-save")

    def save(self, wl: Workload, index: int) -> SaveHandle:
        assert self._writer is not None
        started = time.perf_counter()
        if self._write is not None:
            self._write.result()  # one checkpoint in flight (and its host copy freed)
        sync(wl.device)
        snapshot = {name: t.detach().to("cpu", copy=True) for name, t in wl.tensors().items()}
        write = self._writer.submit(_save, self.path, snapshot)
        del snapshot  # the write owns it: freed when written
        self._write = write
        return writer_handle(started, write)

    def verify(self, wl: Workload, target: Workload, index: int, expected: dict[str, torch.Tensor]) -> tuple[bool, str]:
        if self._write is not None:
            self._write.result()
        loaded = torch.load(self.path, map_location=target.device, weights_only=True)
        dst = target.tensors()
        for name, value in loaded.items():
            dst[name].copy_(value)
        del loaded
        sync(target.device)
        return compare(expected, target.tensors())

    def bytes_on_disk(self) -> int | None:
        return os.path.getsize(self.path) if os.path.exists(self.path) else None

    def teardown(self) -> None:
        try:
            if self._write is not None:
                self._write.result()
        finally:
            self._write = None
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
            shutil.rmtree(self.dir, ignore_errors=True)
