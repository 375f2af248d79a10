"""gc deletes only what no readable manifest needs, and nothing at all when in doubt."""

from __future__ import annotations

from pathlib import Path

import pytest
from faults import chunks_of, commit_checkpoint, small_config

from gpusnap.kernels.hashing import chunk_digest
from gpusnap.storage import Repository, read_pack_index


def _packs(repo: Repository) -> dict[str, set[str]]:
    """pack path -> digests it holds."""
    out = {}
    for fan in repo.backend.listdir("packs"):
        for name in repo.backend.listdir(f"packs/{fan}"):
            index = read_pack_index(repo.backend, f"packs/{fan}/{name}")
            out[index.path] = {digest for digest, _, _ in index.entries}
    return out


def _pack_of(packs: dict[str, set[str]], data: bytes) -> str:
    (path,) = [p for p, digests in packs.items() if chunk_digest(data) in digests]
    return path


@pytest.fixture()
def repo(tmp_path: Path) -> Repository:
    # One writer, four chunks per pack: which chunks share a pack is predictable.
    return Repository.open(tmp_path / "ck", create=True, config=small_config(io_threads=1))


def test_keep_last_deletes_old_checkpoints_and_only_unreferenced_packs(repo: Repository) -> None:
    own_a, shared, own_b, own_c = chunks_of(1, 4), chunks_of(2, 4), chunks_of(3, 4), chunks_of(4, 4)
    a = commit_checkpoint(repo, [own_a, shared], created=1.0)  # packs: [own_a], [shared]
    b = commit_checkpoint(repo, [own_b, shared], created=2.0)  # packs: [own_b]
    c = commit_checkpoint(repo, [own_c, shared], created=3.0)  # packs: [own_c]
    packs = _packs(repo)
    assert len(packs) == 4

    report = repo.gc(keep_last=1)
    assert report.deleted_checkpoints == (a.id, b.id)
    assert set(report.deleted_packs) == {_pack_of(packs, own_a[0]), _pack_of(packs, own_b[0])}
    assert report.freed_bytes > 8 * 512 and not report.skipped
    assert repo.list() == [c]
    survivors = _packs(Repository.open(repo.root))
    assert set(survivors) == {_pack_of(packs, shared[0]), _pack_of(packs, own_c[0])}
    assert Repository.open(repo.root).verify().ok


def test_partly_live_pack_is_kept_whole_without_compaction(repo: Repository) -> None:
    mixed = chunks_of(1, 4)
    commit_checkpoint(repo, [mixed], created=1.0)  # one pack of four chunks
    keep = commit_checkpoint(repo, [mixed[:1]], created=2.0)  # needs one of them
    report = repo.gc(keep_last=1, compact=False)
    assert report.deleted_packs == () and report.compacted_packs == ()
    assert any("partly live" in n and "compaction off" in n for n in report.notes)
    assert report.dead_bytes == 3 * 512
    assert repo.list() == [keep] and repo.verify().ok


def test_a_pack_below_the_compaction_threshold_is_kept_whole(repo: Repository) -> None:
    mixed = chunks_of(1, 4)
    commit_checkpoint(repo, [mixed], created=1.0)
    commit_checkpoint(repo, [mixed[:2]], created=2.0)  # half of it dead: not more than 50%
    report = repo.gc(keep_last=1)
    assert report.compacted_packs == () and report.dead_bytes == 2 * 512
    assert any("at most 50% dead" in n for n in report.notes)


def test_unreadable_manifest_stops_all_pack_deletion(repo: Repository) -> None:
    a = commit_checkpoint(repo, [chunks_of(1, 4)], created=1.0)
    b = commit_checkpoint(repo, [chunks_of(2, 4)], created=2.0)
    bad = Path(repo.backend.describe(f"manifests/{b.id}.json"))
    bad.write_bytes(bad.read_bytes()[:-3])
    repo.delete(a.id)  # a's pack is now garbage, but b's needs are unknown
    packs_before = _packs(repo)

    report = repo.gc(keep_last=0)
    assert report.deleted_packs == () and report.deleted_checkpoints == ()
    assert any("unreadable" in n and str(bad) in n for n in report.notes)
    assert bad.exists() and _packs(repo) == packs_before


def test_stale_tmp_files_are_removed(repo: Repository) -> None:
    tmp = Path(repo.backend.describe("tmp"))
    (tmp / "12345-deadbeef-0001.pack").write_bytes(b"x" * 100)
    report = repo.gc()
    assert list(tmp.iterdir()) == [] and report.freed_bytes == 100


def test_keep_last_none_deletes_no_checkpoint(repo: Repository) -> None:
    commit_checkpoint(repo, [chunks_of(1, 1)])
    commit_checkpoint(repo, [chunks_of(2, 1)])
    assert repo.gc().deleted_checkpoints == () and len(repo.list()) == 2
    with pytest.raises(ValueError):
        repo.gc(keep_last=-1)
