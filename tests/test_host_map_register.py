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


def test_the_loaded_runtime_is_found_in_the_maps_and_a_replaced_file_is_not():
    from gpusnap.device import cudart_in_maps

    head = "7f00-7f10 r-xp 00000000 08:01 123"
    assert cudart_in_maps([f"{head}   /opt/my env/lib/libcudart.so.13\n", f"{head} /usr/lib/libc.so.6\n"]) == \
        "/opt/my env/lib/libcudart.so.13"
    assert cudart_in_maps([f"{head} /old/libcudart.so.13 (deleted)\n"]) is None
    assert cudart_in_maps(["7f00-7f10 rw-p 00000000 00:00 0\n"]) is None


def test_a_runtime_that_cannot_be_cleared_still_gives_the_fallback_error(tmp_path, monkeypatch):
    from gpusnap import device

    monkeypatch.setattr(torch.cuda, "cudart", lambda: SimpleNamespace(cudaHostRegister=lambda *a: SimpleNamespace(value=1)))
    monkeypatch.setattr(device, "loaded_cudart_path", lambda: "/nonexistent/libcudart.so.13")
    monkeypatch.setattr(host_map, "clear_cuda_error", device.clear_cuda_error)
    fd = os.open(tmp_path / "slab", os.O_RDWR | os.O_CREAT, 0o644)
    os.posix_fallocate(fd, 0, 1 << 16)
    with pytest.raises(RuntimeError, match="could not be cleared"):  # not the loader's OSError
        host_map.MappedMemory(fd, 1 << 16, pinned=True)
