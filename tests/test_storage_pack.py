"""Pack files: the trailer index finds every chunk, and a damaged trailer is detected."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusnap.errors import IntegrityError
from gpusnap.kernels.hashing import chunk_digest
from gpusnap.storage.backend import LocalBackend
from gpusnap.storage.pack import FOOTER_SIZE, PACK_END_MAGIC, PACK_MAGIC, PackWriter, pack_path, read_pack_index


def _write_pack(tmp_path: Path, chunks: list[bytes]) -> tuple[LocalBackend, str]:
    backend = LocalBackend(tmp_path)
    writer = PackWriter(backend, "p.pack", fsync=False)
    for c in chunks:
        writer.append(chunk_digest(c), memoryview(c))
    index = writer.finish()
    assert index.size == (tmp_path / "p.pack").stat().st_size
    return backend, "p.pack"


def test_layout_and_index_round_trip(tmp_path: Path) -> None:
    chunks = [b"a" * 100, b"", b"xyz" * 1000]
    backend, path = _write_pack(tmp_path, chunks)
    raw = (tmp_path / path).read_bytes()
    assert raw[:8] == PACK_MAGIC and raw[-8:] == PACK_END_MAGIC
    index = read_pack_index(backend, path)
    assert [digest for digest, _, _ in index.entries] == [chunk_digest(c) for c in chunks]
    for (_, offset, length), c in zip(index.entries, chunks):
        assert raw[offset : offset + length] == c
    assert pack_path(index.pack_id) == f"packs/{index.pack_id[:2]}/{index.pack_id}.pack"


def test_pack_id_is_content_derived(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ids = [read_pack_index(*_write_pack(tmp_path / d, [b"same"] * 2)).pack_id for d in "ab"]
    other = read_pack_index(*_write_pack(tmp_path, [b"different"])).pack_id
    assert ids[0] == ids[1] != other


def test_index_larger_than_one_tail_read(tmp_path: Path) -> None:
    chunks = [i.to_bytes(4, "little") * 8 for i in range(2000)]  # index > 64 KiB
    backend, path = _write_pack(tmp_path, chunks)
    assert len(read_pack_index(backend, path).entries) == 2000


@pytest.mark.parametrize("where", ["index", "footer_digest", "footer_offset", "end_magic"])
def test_damaged_trailer_is_detected(tmp_path: Path, where: str) -> None:
    backend, path = _write_pack(tmp_path, [b"q" * 300, b"r" * 300])
    file = tmp_path / path
    raw = bytearray(file.read_bytes())
    pos = {
        "index": len(raw) - FOOTER_SIZE - 5,
        "footer_digest": len(raw) - 20,
        "footer_offset": len(raw) - FOOTER_SIZE,
        "end_magic": len(raw) - 1,
    }[where]
    raw[pos] ^= 0x40
    file.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="p.pack"):
        read_pack_index(backend, path)


def test_truncated_pack_is_detected(tmp_path: Path) -> None:
    backend, path = _write_pack(tmp_path, [b"q" * 300])
    file = tmp_path / path
    raw = file.read_bytes()
    for cut in (1, FOOTER_SIZE, len(raw) - 4):
        file.write_bytes(raw[: len(raw) - cut])
        with pytest.raises(IntegrityError):
            read_pack_index(backend, path)
