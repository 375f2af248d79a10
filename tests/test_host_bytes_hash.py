"""The fast tier's chunk check on a scratch device gives the host's bits and catches the same
corruption (CI runs the scratch path with a CPU "device"; the H200 runs it on CUDA)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from fast_support import CFG, roots

import gpusnap
from gpusnap.errors import IntegrityError
from gpusnap.kernels.chunk_hash import chunk_hashes, hex_rows
from gpusnap.storage.host_bytes_hash import hash_host_bytes
from gpusnap.storage.promote import promote
from gpusnap.storage.repository import Repository


@pytest.mark.parametrize("device", [None, torch.device("cpu")] + (
    [torch.device("cuda")] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("nbytes", [0, 16, 1000, 65536, 65536 * 3 + 48])
def test_scratch_hashes_are_the_hosts(device: torch.device | None, nbytes: int) -> None:
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    want = hex_rows(chunk_hashes(data, 65536, impl="torch").numpy())
    assert hash_host_bytes(memoryview(data.numpy()), 65536, device) == want
    assert hash_host_bytes(memoryview(data.numpy()), 65536, device) == want  # (scratch reused)


@pytest.mark.parametrize("slice_bytes", [1, 65536, 65536 * 2, 1 << 30])
@pytest.mark.parametrize("nbytes", [0, 16, 65536 * 3 + 48, 65536 * 5])
def test_hashing_in_slices_gives_the_same_hashes(slice_bytes: int, nbytes: int) -> None:
    # a restore's reader threads check device-named runs a few MiB at a time (a small scratch)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes + 1))
    want = hex_rows(chunk_hashes(data, 65536, impl="torch").numpy())
    assert hash_host_bytes(memoryview(data.numpy()), 65536, torch.device("cpu"), slice_bytes=slice_bytes) == want


def test_only_gpu_names_a_single_indexed_cuda_device() -> None:
    from gpusnap.device import only_gpu

    assert only_gpu([torch.device("cuda", 1), torch.device("cuda", 1)]) == torch.device("cuda", 1)
    assert only_gpu([torch.device("cuda", 0), torch.device("cuda", 1)]) is None
    assert only_gpu([torch.device("cpu")]) is None and only_gpu([]) is None
    assert only_gpu([torch.device("cuda")]) is None  # (no index: the caller's current device is not the targets')


def test_a_promotion_checked_on_a_scratch_device_refuses_a_corrupt_slab(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = {"w": torch.arange(100_000, dtype=torch.float32)}
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, promote_every=1000) as ck:
        info = ck.save(state).wait()
        tier = ck._tiers.fast()
        assert tier is not None
        tier.check_device = torch.device("cpu")
        good = Repository.open(fast)
        good.check_device = torch.device("cpu")  # type: ignore[attr-defined]
        assert good.verify().ok
        slab = next((fast / "slabs").iterdir())
        with open(slab, "r+b") as f:  # one byte of the checkpoint's first chunk flipped
            f.seek(0)
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 0xFF]))
        bad = Repository.open(fast)
        bad.check_device = torch.device("cpu")  # type: ignore[attr-defined]
        assert not bad.verify().ok
        manifest = next(m for m in tier._scan()[0] if m.id == info.id)
        with pytest.raises(IntegrityError, match="does not match its hash"):
            promote(tier, manifest, ck._tiers.durable(create=True))
    assert Repository.open(durable).list() == []  # nothing corrupt became durable


@pytest.mark.cuda
def test_the_cuda_scratch_comes_from_its_own_streams_pool_never_the_programs() -> None:
    # A block the caching allocator hands out on the program's stream may be memory that
    # kernels the program queued before freeing it still read or write: the scratch, written
    # on the hash's own stream, would race them. Allocated on its own stream, the allocator
    # only ever gives it blocks that stream freed.
    from gpusnap.storage import host_bytes_hash

    n = 64 << 20
    x = torch.ones(n, dtype=torch.uint8, device="cuda")
    del x  # (a free block of the right size on the program's stream)
    data = torch.zeros(n, dtype=torch.uint8).pin_memory()
    got: list[object] = []

    def hash_on_a_fresh_thread() -> None:  # (a fresh thread: a fresh scratch)
        got.append(hash_host_bytes(memoryview(data.numpy()), 4 << 20, torch.device("cuda")))
        got.append(host_bytes_hash._local.scratch)

    worker = threading.Thread(target=hash_on_a_fresh_thread)
    worker.start()
    worker.join()
    assert got[0] == hex_rows(chunk_hashes(data, 4 << 20, impl="torch").numpy())
    _device, stream, buf = got[1]  # type: ignore[misc]
    ptr = buf.data_ptr()
    segment = next(s for s in torch.cuda.memory_snapshot()
                   if s["address"] <= ptr < s["address"] + s["total_size"])
    assert segment["stream"] == stream.cuda_stream != torch.cuda.current_stream().cuda_stream
