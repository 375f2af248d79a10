"""A refused page-lock (``cudaHostRegister`` of a file on a filesystem that does not allow
it) is a ``RuntimeError`` the fast tier falls back from (pageable slabs), with the runtime's
error read so the program's next CUDA call does not see it. It was an ``AttributeError``:
torch's ``cudart()`` has no ``cudaGetLastError``, and every save into such a tier failed."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from gpusnap import host_map


def test_a_refused_page_lock_raises_runtime_error_and_clears_the_error(tmp_path, monkeypatch):
    cleared = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: SimpleNamespace(cudaHostRegister=lambda *a: SimpleNamespace(value=1)))
    monkeypatch.setattr(host_map, "clear_cuda_error", lambda: cleared.append(True))
    path = tmp_path / "slab"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.posix_fallocate(fd, 0, 1 << 16)
    with pytest.raises(RuntimeError, match="cudaHostRegister of 65536 bytes failed: error 1"):
        host_map.MappedMemory(fd, 1 << 16, pinned=True)
    assert cleared == [True]
    fresh = host_map.MappedMemory(os.open(path, os.O_RDWR), 1 << 16, pinned=False)  # the fallback
    assert fresh.tensor.numel() == 1 << 16 and not fresh.pinned
