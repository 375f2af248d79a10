"""Packs written with O_DIRECT: the same format to readers, chunks where the index says,
whole aligned chunks back to back, and a buffered fallback where the file system refuses it."""

from __future__ import annotations

import errno
import fcntl
import itertools
import mmap
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gpusnap
from gpusnap.kernels.hashing import chunk_digest
from gpusnap.storage.backend import LocalBackend
from gpusnap.storage.direct_file import BLOCK, DIRECT_MIN
from gpusnap.storage.pack import PACK_MAGIC, PackWriter, read_pack_index

O_DIRECT = getattr(os, "O_DIRECT", 0)
needs_o_direct = pytest.mark.skipif(not O_DIRECT, reason="os.O_DIRECT is Linux-only")
LENGTHS = [0, 1, 4095, 4096, 4097, 8192, DIRECT_MIN, DIRECT_MIN + 1, 1000003, 4 << 20]


def _random(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _aligned(data: bytes) -> memoryview:
    """``data`` copied into page-aligned memory (an anonymous mapping)."""
    m = mmap.mmap(-1, max(len(data), 1))
    m[: len(data)] = data
    return memoryview(m)[: len(data)]


def _source(data: bytes, kind: str) -> memoryview:
    if kind == "aligned":
        return _aligned(data)
    if kind == "unaligned":
        return memoryview(bytearray(b"\x00" + data))[1:]  # one byte past the allocation's start
    return memoryview(bytes(data))  # read-only


def _takes_o_direct(directory: str | Path) -> bool:
    """Whether ``directory``'s file system takes an aligned O_DIRECT write."""
    path = os.path.join(directory, "probe")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.pwrite(fd, mmap.mmap(-1, BLOCK), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.remove(path)


def _write(root: Path, chunks: list[memoryview], *, direct: bool = True) -> tuple[LocalBackend, PackWriter]:
    backend = LocalBackend(root)
    writer = PackWriter(backend, "p.pack", fsync=True, direct=direct)
    for c in chunks:
        writer.append(chunk_digest(c), c)
    index = writer.finish()
    assert index.size == writer.nbytes == (root / "p.pack").stat().st_size
    return backend, writer


def _check_reads_back(backend: LocalBackend, chunks: list[memoryview]) -> list[tuple[str, int, int]]:
    index = read_pack_index(backend, "p.pack")
    assert [d for d, _, _ in index.entries] == [chunk_digest(c) for c in chunks]
    for (_, offset, length), c in zip(index.entries, chunks, strict=True):
        assert length == len(c)
        assert backend.read_range("p.pack", offset, length) == bytes(c)
    assert backend.read_range("p.pack", 0, len(PACK_MAGIC)) == PACK_MAGIC
    return list(index.entries)


@needs_o_direct
@pytest.mark.parametrize("kind", ["aligned", "unaligned", "read-only"])
def test_every_length_and_source_reads_back(tmp_path: Path, kind: str) -> None:
    chunks = [_source(_random(n, seed), kind) for seed, n in enumerate(LENGTHS)]
    chunks += chunks[::-1]  # (odd tails before large chunks too)
    backend, writer = _write(tmp_path, chunks)
    assert writer.direct == _takes_o_direct(tmp_path)
    entries = _check_reads_back(backend, chunks)
    if writer.direct and kind == "aligned":
        big = [offset for _, offset, length in entries if length >= DIRECT_MIN]
        assert big and all(offset % BLOCK == 0 for offset in big), "large aligned chunks start on a block"
        assert entries[0][1] == 8, "a zero-length chunk is not moved"
    assert stat.S_IMODE((tmp_path / "p.pack").stat().st_mode) == 0o600


@needs_o_direct
@pytest.mark.parametrize("length", [4096, 512, DIRECT_MIN * 2, 4 << 20])
def test_whole_chunks_in_order_lie_back_to_back(tmp_path: Path, length: int) -> None:
    data = _aligned(_random(length * 6, 7))
    chunks = [data[i * length : (i + 1) * length] for i in range(6)]
    backend, writer = _write(tmp_path, chunks)
    entries = _check_reads_back(backend, chunks)
    for (_, a, n), (_, b, _) in itertools.pairwise(entries):
        assert a + n == b
    if writer.direct and length >= DIRECT_MIN:
        assert entries[0][1] == BLOCK, "the first large aligned chunk follows the header's block"


@needs_o_direct
def test_a_large_aligned_chunk_after_an_odd_tail_starts_on_a_block(tmp_path: Path) -> None:
    chunks = [_aligned(_random(1000003, 1)), _aligned(_random(DIRECT_MIN, 2)), _aligned(_random(3, 3))]
    backend, writer = _write(tmp_path, chunks)
    entries = _check_reads_back(backend, chunks)
    if writer.direct:
        assert [offset for _, offset, _ in entries] == [BLOCK, BLOCK + 1003520, BLOCK + 1003520 + DIRECT_MIN]
        raw = (tmp_path / "p.pack").read_bytes()
        assert raw[len(PACK_MAGIC) : BLOCK] == bytes(BLOCK - len(PACK_MAGIC)), "the gaps are zeros"
        assert raw[BLOCK + 1000003 : BLOCK + 1003520] == bytes(1003520 - 1000003)


def test_buffered_writer_keeps_the_format(tmp_path: Path) -> None:
    chunks = [_aligned(_random(n, n)) for n in (DIRECT_MIN, 3, 1 << 20)]
    backend, writer = _write(tmp_path, chunks, direct=False)
    assert not writer.direct
    entries = _check_reads_back(backend, chunks)
    assert [offset for _, offset, _ in entries] == [8, 8 + DIRECT_MIN, 8 + DIRECT_MIN + 3]


class _Forwarding:
    """A wrapper forwarding unknown names, as the fault-injecting test backends do."""

    def __init__(self, inner: LocalBackend) -> None:
        self.inner = inner
        self.opened: list[str] = []

    def open_write(self, path: str) -> Any:
        self.opened.append(path)
        return self.inner.open_write(path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_forwarding_wrapper_keeps_seeing_every_write(tmp_path: Path) -> None:
    wrapper = _Forwarding(LocalBackend(tmp_path))
    writer = PackWriter(wrapper, "p.pack", fsync=False, direct=True)
    writer.append("x", memoryview(b"abc"))
    writer.finish()
    assert wrapper.opened == ["p.pack"] and not writer.direct


def test_discard_removes_a_direct_pack(tmp_path: Path) -> None:
    writer = PackWriter(LocalBackend(tmp_path), "p.pack", fsync=False, direct=True)
    writer.append("x", _aligned(_random(DIRECT_MIN + 5, 0)))
    writer.discard()
    assert not (tmp_path / "p.pack").exists()


# -- the buffered fallback --------------------------------------------------------------------
@pytest.fixture
def shm_dir() -> Iterator[Path]:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    path = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path)


@needs_o_direct
def test_tmpfs_refusing_o_direct_falls_back(shm_dir: Path) -> None:
    if _takes_o_direct(shm_dir):
        pytest.skip("this kernel's tmpfs takes O_DIRECT (Linux >= 6.6): the faked refusals below cover the fallback")
    chunks = [_aligned(_random(n, n)) for n in LENGTHS]
    backend, writer = _write(shm_dir / "root", chunks)
    assert not writer.direct
    _check_reads_back(backend, chunks)


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT)


@needs_o_direct
@pytest.mark.parametrize("refused_at", ["open", "first write"])
def test_refused_o_direct_falls_back_to_the_buffered_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused_at: str
) -> None:
    chunks = [_aligned(_random(n, n)) for n in LENGTHS]
    _write(tmp_path / "plain", chunks, direct=False)
    real_open, real_pwrite = os.open, os.pwrite

    def refusing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT refused", path)
        return real_open(path, flags, *args, **kwargs)

    def refusing_pwrite(fd: int, data: Any, offset: int) -> int:
        if _is_direct(fd):
            raise OSError(errno.EINVAL, "O_DIRECT write refused")
        return real_pwrite(fd, data, offset)

    if refused_at == "open":
        monkeypatch.setattr(os, "open", refusing_open)
    else:
        monkeypatch.setattr(os, "pwrite", refusing_pwrite)
    backend, writer = _write(tmp_path / "fell_back", chunks)
    monkeypatch.undo()
    assert not writer.direct
    _check_reads_back(backend, chunks)
    fell_back = (tmp_path / "fell_back" / "p.pack").read_bytes()
    assert fell_back == (tmp_path / "plain" / "p.pack").read_bytes(), "a buffered pack has no padding"
    assert stat.S_IMODE((tmp_path / "fell_back" / "p.pack").stat().st_mode) == 0o600


@needs_o_direct
def test_other_errors_are_not_hidden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_pwrite = os.pwrite

    def full_disk(fd: int, data: Any, offset: int) -> int:
        if offset >= BLOCK:
            raise OSError(errno.ENOSPC, "no space left")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full_disk)
    writer = PackWriter(LocalBackend(tmp_path), "p.pack", fsync=False, direct=True)
    with pytest.raises(OSError) as caught:
        writer.append("x", _aligned(_random(4 * BLOCK, 0)))
        writer.append("y", _aligned(_random(9 << 20, 0)))
    assert caught.value.errno == errno.ENOSPC
    writer.discard()
    assert not (tmp_path / "p.pack").exists()


# -- end to end --------------------------------------------------------------------------------
@pytest.mark.parametrize("direct_writes", ["auto", "off"])
def test_checkpointer_round_trip_is_bit_exact(tmp_path: Path, direct_writes: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 3))  # 1 MiB and odd tails
    extra = torch.randn(1000003 // 4 + 1)
    state: dict[str, Any] = {"model": model, "extra": extra, "step": 5}
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    extra_before = extra.clone()
    config = gpusnap.Config(direct_writes=direct_writes, memory_tier="off")
    with gpusnap.Checkpointer(tmp_path / "root", config=config) as ck:
        ck.save(state, blocking=True).wait()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(7)
        extra.zero_()
        ck.restore(state).wait()
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert torch.equal(extra, extra_before) and state["step"] == 5
    packs = sorted((tmp_path / "root" / "packs").rglob("*.pack"))
    assert packs
    backend = LocalBackend(tmp_path / "root")
    for pack in packs:
        entries = read_pack_index(backend, pack.relative_to(tmp_path / "root").as_posix()).entries
        if direct_writes == "off":  # today's format: chunks back to back after the header
            ends = [8] + [offset + length for _, offset, length in entries]
            assert [offset for _, offset, _ in entries] == ends[:-1]
