"""gc compacts packs that are mostly dead: their live chunks are rewritten into new packs, the
old ones deleted, and every checkpoint still restores bit-exactly (storage/compact.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from faults import any_root, chunks_of, commit_checkpoint, small_config

import gpusnap
from gpusnap import Config
from gpusnap.cli.du import usage
from gpusnap.cli.main import main as cli_main
from gpusnap.errors import StorageError
from gpusnap.kernels.hashing import chunk_digest
from gpusnap.storage import Repository
from gpusnap.storage.manifest import Manifest, RankPart
from gpusnap.storage.ranks import RANK_ROOT_DOC, rank_root
from gpusnap.storage.repository import GcReport

KIB = 1024


def _config() -> Config:
    # 16 chunks of 4 KiB per pack: one save of the 64 KiB tensor below fills one pack
    return Config(chunk_size=4 * KIB, pack_size=64 * KIB, io_threads=1, staging_bytes=4 * KIB)


def _dead(root: Path | str) -> int:
    repo = Repository.open(root)
    return usage(repo, repo.list()).dead


def _restores(root: Path | str, cid: str, expected: torch.Tensor) -> None:
    state = {"w": torch.zeros_like(expected), "step": -1}
    gpusnap.Checkpointer(root, config=_config()).restore(state, cid).wait()
    assert torch.equal(state["w"], expected), cid


def test_saves_that_leave_a_pack_mostly_dead_are_compacted_and_restore_bit_exact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ck"
    w = torch.arange(16 * KIB, dtype=torch.float32)  # 64 KiB: 16 chunks
    saved: dict[str, torch.Tensor] = {}
    with gpusnap.Checkpointer(root, keep_last=2, config=_config()) as ck:
        for step in range(4):
            if step:
                w[: 12 * KIB] += 1  # 12 of 16 chunks change; the last 4 stay the first save's
            saved[ck.save({"w": w, "step": step}).wait().id] = w.clone()
    kept = [m.id for m in Repository.open(root).list()]
    assert len(kept) == 2
    before = _dead(root)
    assert before == 12 * 4 * KIB  # retention kept the first save's pack whole: it never compacts

    assert cli_main(["gc", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "gpusnap.gc/1" and len(doc["compacted_packs"]) == 1 and len(doc["written_packs"]) == 1
    assert doc["rewritten_bytes"] == 4 * 4 * KIB and doc["dead_bytes"] == 0
    assert doc["compacted_bytes"] > 11 * 4 * KIB and doc["freed_bytes"] == doc["compacted_bytes"]
    assert _dead(root) == 0
    assert Repository.open(root).verify().ok
    for cid in kept:
        _restores(root, cid, saved[cid])

    assert cli_main(["gc", str(root)]) == 0  # nothing left to do
    out = capsys.readouterr().out
    assert out.startswith("deleted 0 checkpoint(s) and 0 pack(s), freed 0 B") and "compacted" not in out


@pytest.fixture()
def mostly_dead(tmp_path: Path) -> Iterator[tuple[Repository, Manifest, list[bytes]]]:
    """Two packs of four chunks, each three quarters dead, and one checkpoint (returned)
    needing a chunk of each, with four chunks of its own in a third pack."""
    with any_root("local", tmp_path) as root:
        yield _mostly_dead(root)


def _mostly_dead(root: str) -> tuple[Repository, Manifest, list[bytes]]:
    repo = Repository.open(root, create=True, config=small_config(io_threads=1))
    a = chunks_of(1, 8)
    old = commit_checkpoint(repo, [a], created=1.0)
    chunks = [a[0], a[4], *chunks_of(2, 4)]
    keep = commit_checkpoint(repo, [chunks], created=2.0)
    repo.delete(old.id)
    return repo, keep, chunks


class _LeaseLostAfterOneCheck:
    """A backend whose writer lease passes its first check, then is found taken over (an
    object store's lease, idle past its TTL): gc's own check passes, compaction's fails."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.root = inner.root

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def writer_lease(self, owner: dict[str, Any], timeout: float) -> Any:
        lease = self.inner.writer_lease(owner, timeout)
        checks: list[int] = []

        class Lost:
            def confirm(self) -> None:
                checks.append(1)
                if len(checks) > 1:
                    raise OSError(116, "this writer's lease was taken over by pid 1 on elsewhere", "writer")
                lease.confirm()

            def release(self) -> None:
                lease.release()

        return Lost()


def _packs(repo: Repository) -> set[str]:
    return set(repo.pack_paths())


def _readable(root: str, chunks: list[bytes]) -> None:
    fresh = Repository.open(root)
    assert [fresh.read_chunk(chunk_digest(c)) for c in chunks] == chunks
    report = fresh.verify()
    assert report.ok, report.problems


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_compaction_on_each_backend(kind: str, tmp_path: Path) -> None:
    with any_root(kind, tmp_path) as root:
        repo, keep, chunks = _mostly_dead(root)
        before = _packs(repo)
        report = repo.gc()
        assert len(report.compacted_packs) == 2 and len(report.written_packs) == 1
        assert report.rewritten_bytes == 2 * 512 and report.dead_bytes == 0 and report.problems == ()
        assert _packs(repo) == (before - set(report.compacted_packs)) | set(report.written_packs)
        assert report.freed_bytes == report.compacted_bytes > 0
        _readable(root, chunks)
        again = repo.gc()
        assert again == GcReport()  # a second gc is a no-op


def test_a_corrupt_live_chunk_is_never_copied_and_its_pack_is_kept(
    mostly_dead: tuple[Repository, Manifest, list[bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    repo, _keep, chunks = mostly_dead
    path, offset, _n = repo._locate(chunk_digest(chunks[0]), "")
    pack = Path(repo.backend.describe(path))
    data = bytearray(pack.read_bytes())
    data[offset + 100] ^= 0xFF
    pack.write_bytes(bytes(data))

    assert cli_main(["gc", repo.root]) == 1  # damage found, as verify says it
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("CORRUPT: ")]
    assert f"chunk {chunk_digest(chunks[0])}" in line and str(pack) in line and "does not match its digest" in line
    assert "compacted 1 mostly dead pack(s) into 1" in out
    assert pack.exists()  # kept whole: its corrupt chunk is nowhere else
    fresh = Repository.open(repo.root)
    assert fresh.read_chunk(chunk_digest(chunks[1])) == chunks[1]  # the other pack was compacted
    problems = fresh.verify().problems
    assert len(problems) == 1 and "does not match its digest" in problems[0]


def test_after_a_failed_delete_the_next_gc_copies_nothing(
    mostly_dead: tuple[Repository, Manifest, list[bytes]]
) -> None:
    repo, _keep, chunks = mostly_dead
    real_remove = repo.backend.remove

    def remove(path: str) -> None:
        if path.startswith("packs/"):
            raise OSError(5, "Input/output error", path)
        real_remove(path)

    repo.backend.remove = remove  # type: ignore[method-assign]
    with pytest.raises(StorageError, match="gc: deleting compacted pack .* failed: Input/output error.*kept whole"):
        repo.gc()
    del repo.backend.remove
    _readable(repo.root, chunks)  # old and new packs both hold the live chunks now

    report = Repository.open(repo.root, config=small_config(io_threads=1)).gc()
    assert len(report.compacted_packs) == 2 and report.written_packs == () and report.rewritten_bytes == 0
    assert report.dead_bytes == 0
    _readable(repo.root, chunks)


def test_a_corrupt_copy_in_a_kept_pack_is_not_trusted(
    mostly_dead: tuple[Repository, Manifest, list[bytes]]
) -> None:
    repo, _keep, chunks = mostly_dead
    old = _packs(repo)
    a0 = chunk_digest(chunks[0])
    real_remove = repo.backend.remove
    repo.backend.remove = lambda path: (_ for _ in ()).throw(OSError(5, "EIO", path))  # type: ignore[method-assign]
    with pytest.raises(StorageError):
        repo.gc()  # the new pack is published, the old ones stay
    repo.backend.remove = real_remove  # type: ignore[method-assign]
    (new,) = _packs(repo) - old
    fresh = Repository.open(repo.root, config=small_config(io_threads=1))
    fresh.forget_packs(sorted(old))
    _path, offset, _n = fresh._locate(a0, "")
    target = Path(fresh.backend.describe(new))
    data = bytearray(target.read_bytes())
    data[offset] ^= 0xFF  # the new copy of a0 rots
    target.write_bytes(bytes(data))

    report = Repository.open(repo.root, config=small_config(io_threads=1)).gc()
    assert len(report.problems) == 1 and a0 in report.problems[0] and str(target) in report.problems[0]
    assert report.rewritten_bytes == 512  # a0 again, from the old pack; a4's new copy is good
    assert len(report.compacted_packs) == 2


def test_compaction_waits_for_a_reader_holding_the_root(
    mostly_dead: tuple[Repository, Manifest, list[bytes]]
) -> None:
    repo, _keep, chunks = mostly_dead
    before = _packs(repo)
    held = Repository.open(repo.root).backend.lock(exclusive=False, timeout=0)  # what verify holds
    try:
        with pytest.raises(StorageError, match="gc or save in progress, or a verify"):
            repo.gc(timeout=0.05)
        report = repo.gc(blocking=False)
        assert report.skipped and report.compacted_packs == ()
        assert _packs(repo) == before
    finally:
        held.release()
    assert len(repo.gc().compacted_packs) == 2
    _readable(repo.root, chunks)


def test_a_restore_that_knew_the_old_packs_finds_the_new_ones(
    mostly_dead: tuple[Repository, Manifest, list[bytes]]
) -> None:
    repo, _keep, chunks = mostly_dead
    reader = Repository.open(repo.root)  # another process's view: it indexed the old packs
    assert reader.read_chunk(chunk_digest(chunks[0])) == chunks[0]
    assert len(repo.gc().compacted_packs) == 2
    assert [reader.read_chunk(chunk_digest(c)) for c in chunks] == chunks
    out = bytearray(2 * 512)
    reader.read_chunks_into([chunk_digest(c) for c in chunks[:2]], memoryview(out), 512)
    assert bytes(out) == chunks[0] + chunks[1]


def test_no_compaction_while_this_objects_own_save_writes(
    mostly_dead: tuple[Repository, Manifest, list[bytes]]
) -> None:
    repo, _keep, _chunks = mostly_dead
    with repo.begin_write() as txn:
        report = repo.gc()
        txn.abort()
    assert report.compacted_packs == () and report.dead_bytes == 6 * 512
    assert any("needs the root to itself" in n for n in report.notes)
    assert repo.gc(compact=False).compacted_packs == ()
    assert len(repo.gc().compacted_packs) == 2


def test_the_threshold_and_the_cli_flags(
    mostly_dead: tuple[Repository, Manifest, list[bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    repo, _keep, chunks = mostly_dead
    assert cli_main(["gc", repo.root, "--compact-percent", "101"]) == 2
    assert "gc_compact_percent must be between 0 and 100" in capsys.readouterr().err
    assert cli_main(["gc", repo.root, "--no-compact"]) == 0
    assert "compaction off" in capsys.readouterr().out
    assert cli_main(["gc", repo.root, "--compact-percent", "75"]) == 0  # 75% dead is not more than 75%
    assert "each at most 75% dead" in capsys.readouterr().out
    assert cli_main(["gc", repo.root, "--compact-percent", "74"]) == 0
    assert "compacted 2 mostly dead pack(s) into 1" in capsys.readouterr().out
    _readable(repo.root, chunks)


def _rank_part(root: Path, rank: int, cid: str, created: float, chunks: list[bytes]) -> RankPart:
    sub = Repository.open(rank_root(root, rank), create=True, config=small_config(io_threads=1),
                          root_doc=RANK_ROOT_DOC)
    m = commit_checkpoint(sub, [chunks], created=created, checkpoint_id=cid)
    return RankPart(rank, m.checksum, m.nbytes)


def test_gc_of_a_distributed_root_compacts_every_ranks_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "dist"
    top = Repository.open(root, create=True, config=small_config(io_threads=1))
    a = {r: chunks_of(10 + r, 8) for r in (0, 1)}
    for step, created in ((0, 1.0), (1, 2.0)):
        cid = top.new_id(created)
        parts = tuple(
            _rank_part(root, r, cid, created, a[r] if step == 0 else [a[r][0], a[r][4], *chunks_of(20 + r, 4)])
            for r in (0, 1)
        )
        with top.begin_write() as txn:
            txn.commit(Manifest(id=cid, tag=None, created=created, chunk_size=512, storages=(),
                                tree={"t": "ranks"}, stats={}, ranks=parts))
    assert cli_main(["gc", str(root), "--keep-last", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["deleted_checkpoints"]) == 1
    assert len(doc["compacted_packs"]) == 4 and len(doc["written_packs"]) == 2 and doc["dead_bytes"] == 0
    assert cli_main(["verify", str(root)]) == 0
    repo = Repository.open(root)
    for r in (0, 1):
        assert repo.read_chunk(chunk_digest(a[r][4])) == a[r][4]


def test_live_chunks_fill_new_packs_of_at_most_pack_size(tmp_path: Path) -> None:
    repo = Repository.open(tmp_path / "ck", create=True, config=small_config(io_threads=1, gc_compact_percent=0))
    a = chunks_of(1, 16)
    old = commit_checkpoint(repo, [a], created=1.0)  # four packs of four chunks
    live = [c for i, c in enumerate(a) if i % 4 < 2]  # half of each pack
    commit_checkpoint(repo, [live], created=2.0)
    repo.delete(old.id)
    report = repo.gc()
    assert len(report.compacted_packs) == 4 and len(report.written_packs) == 2  # 8 chunks, 4 per pack
    assert report.rewritten_bytes == 8 * 512 and report.dead_bytes == 0
    _readable(repo.root, live)


def test_a_lease_lost_while_compacting_deletes_no_old_pack(
    mostly_dead: tuple[Repository, Manifest, list[bytes]],
) -> None:
    repo, _keep, chunks = mostly_dead
    before = _packs(repo)
    lost = Repository.open(repo.root, config=repo.config, backend=_LeaseLostAfterOneCheck(repo.backend))
    with pytest.raises(StorageError, match="gc: confirming the writer lease .* taken over .*kept whole"):
        lost.gc()
    assert before <= _packs(repo)  # every old pack is still there (the new one too)
    _readable(repo.root, chunks)


def test_a_verify_that_could_not_lock_the_root_follows_a_compaction_elsewhere(
    mostly_dead: tuple[Repository, Manifest, list[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    repo, _keep, chunks = mostly_dead
    reader = Repository.open(repo.root)
    # verify waits 30 s for the shared lock, then checks without it: here at once
    monkeypatch.setattr(reader.backend, "lock", lambda **_: (_ for _ in ()).throw(TimeoutError("busy")))
    real_read = reader.backend.read_range
    compacted: list[GcReport] = []

    def read_range(path: str, offset: int = 0, length: int | None = None) -> bytes:
        if path.startswith("packs/") and length == 512 and not compacted:
            compacted.append(repo.gc())  # the gc elsewhere runs between the listing and the reads
        return real_read(path, offset, length)

    monkeypatch.setattr(reader.backend, "read_range", read_range)
    report = reader.verify()
    assert len(compacted[0].compacted_packs) == 2
    assert report.ok, report.problems
    assert report.checked_chunks == len(chunks)
