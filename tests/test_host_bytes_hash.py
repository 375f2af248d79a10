"""The fast tier's chunk check on a scratch device gives the host's bits and catches the same
corruption (CI runs the scratch path with a CPU "device"; the H200 runs it on CUDA)."""

from __future__ import annotations

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


def test_a_promotion_checked_on_a_scratch_device_refuses_a_corrupt_slab(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = {"w": torch.arange(100_000, dtype=torch.float32)}
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, promote_every=1000) as ck:
        info = ck.save(state).wait()
        tier = ck._fast
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
            promote(tier, manifest, ck._repository(create=True))
    assert Repository.open(durable).list() == []  # nothing corrupt became durable
