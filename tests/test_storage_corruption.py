"""Damaged bytes are found: reads raise IntegrityError naming the pack, verify pinpoints the checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from faults import chunks_of, commit_checkpoint, small_config

from gpusnap.errors import IntegrityError
from gpusnap.storage import Manifest, Repository, read_pack_index


def _locate(repo: Repository, digest: str) -> tuple[Path, int]:
    """(pack file, offset) of ``digest``, straight from the pack trailers."""
    for fan in repo.backend.listdir("packs"):
        for name in repo.backend.listdir(f"packs/{fan}"):
            index = read_pack_index(repo.backend, f"packs/{fan}/{name}")
            for d, offset, _ in index.entries:
                if d == digest:
                    return Path(repo.backend.describe(index.path)), offset
    raise AssertionError(f"{digest} not stored")


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.fixture()
def two(tmp_path: Path) -> tuple[Repository, Manifest, Manifest]:
    repo = Repository.open(tmp_path / "ck", create=True, config=small_config())
    a = commit_checkpoint(repo, [chunks_of(1, 6)], created=1.0)
    b = commit_checkpoint(repo, [chunks_of(2, 6)], created=2.0)
    return repo, a, b


def test_flipped_chunk_byte_fails_read_and_verify_of_that_checkpoint_only(
    two: tuple[Repository, Manifest, Manifest],
) -> None:
    repo, a, b = two
    bad = a.storages[0].chunks[3]
    pack, offset = _locate(repo, bad)
    _flip(pack, offset + 100)

    with pytest.raises(IntegrityError) as info:
        repo.read_chunk(bad, what="model.layers.0.weight")
    assert str(pack) in str(info.value) and "model.layers.0.weight" in str(info.value)
    with pytest.raises(IntegrityError, match="optim.state"):
        repo.read_chunk_into(bad, memoryview(bytearray(len(chunks_of(1, 6)[3]))), what="optim.state")

    assert repo.verify(b.id).ok
    report_a = repo.verify(a.id)
    assert not report_a.ok and len(report_a.problems) == 1 and bad in report_a.problems[0]
    everything = repo.verify()
    assert not everything.ok and everything.checked_checkpoints == 2
    assert all(a.id in p for p in everything.problems)
    assert repo.list() == [a, b]  # the manifests themselves are fine


def test_verify_reports_progress_bytes(two: tuple[Repository, Manifest, Manifest]) -> None:
    repo, a, b = two
    seen: list[int] = []
    report = repo.verify(progress=seen.append)
    assert report.ok and sum(seen) == report.checked_bytes == a.nbytes + b.nbytes


def test_corrupt_manifest_is_a_problem_not_a_checkpoint(two: tuple[Repository, Manifest, Manifest]) -> None:
    repo, a, b = two
    path = Path(repo.backend.describe(f"manifests/{b.id}.json"))
    _flip(path, 40)
    fresh = Repository.open(repo.root)
    assert fresh.list() == [a]
    (problem,) = fresh.problems()
    assert problem[0] == str(path) and "corrupt" in problem[1]
    report = fresh.verify()
    assert not report.ok and any(b.id in p for p in report.problems)
    assert fresh.verify(a.id).ok


def test_truncated_manifest_is_a_problem(two: tuple[Repository, Manifest, Manifest]) -> None:
    repo, a, b = two
    path = Path(repo.backend.describe(f"manifests/{b.id}.json"))
    path.write_bytes(path.read_bytes()[:-7])
    fresh = Repository.open(repo.root)
    assert fresh.list() == [a] and len(fresh.problems()) == 1


def test_damaged_pack_trailer_makes_its_chunks_missing(two: tuple[Repository, Manifest, Manifest]) -> None:
    repo, a, b = two
    pack, _ = _locate(repo, a.storages[0].chunks[0])
    _flip(pack, pack.stat().st_size - 45)  # inside the JSON index
    fresh = Repository.open(repo.root)
    with pytest.raises(IntegrityError, match="missing"):
        fresh.read_chunk(a.storages[0].chunks[0])
    report = fresh.verify()
    assert not report.ok and any(str(pack) in p for p in report.problems)
    assert fresh.verify(b.id).ok


def test_missing_pack_is_reported(two: tuple[Repository, Manifest, Manifest]) -> None:
    repo, a, b = two
    pack, _ = _locate(repo, a.storages[0].chunks[5])
    pack.unlink()
    with pytest.raises(IntegrityError, match="missing"):
        repo.read_chunk(a.storages[0].chunks[5], what="w")  # stale index: re-listed on the miss
    assert not repo.verify(a.id).ok and repo.verify(b.id).ok
