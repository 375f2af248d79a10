"""Integrity of the fast tier: corrupt slab bytes are an IntegrityError naming the tensor (and
``verify`` finds them); a reader holding a deleted checkpoint's manifest whose slab bytes were
reused gets an IntegrityError, never other bytes silently."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from fast_support import (
    CFG,
    blank_state,
    locations,
    make_state,
    overlapping,
    roots,
    saved_for_promotion,
    same,
    snapshot,
    train,
)

import gpusnap
from gpusnap.cli.main import main as cli_main
from gpusnap.storage.fast_tier import FastTier, chunk_location, slab_path
from gpusnap.storage.repository import Repository


def _flip(fast: Path, chunk: str, at: int = 5) -> None:
    """Flip one byte of chunk ``chunk`` (a fast chunk name) where its slab holds it."""
    _h, slab, offset, _n = chunk_location(chunk)
    with open(fast / slab_path(slab), "r+b") as f:
        f.seek(offset + at)
        byte = f.read(1)
        f.seek(offset + at)
        f.write(bytes([byte[0] ^ 0x40]))


def _chunk_of(fast: Path, checkpoint: str, key: str) -> str:
    """The first chunk of the storage behind the top-level tensor ``key``."""
    manifest = Repository.open(fast).load_manifest(checkpoint)
    # a dict node's items are [key node, value node] pairs; a str key is {"t": "v", "v": key}
    node = next(v for k, v in manifest.tree["items"] if k == {"t": "v", "v": key})
    assert node["t"] == "tensor", node
    return manifest.storages[node["storage"]].chunks[0]


def test_a_flipped_slab_byte_fails_restore_naming_the_tensor_and_verify_finds_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(1)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        info = ck.save(state).wait()
    bad = _chunk_of(fast, info.id, "x")
    _flip(fast, bad)
    target = blank_state(state)
    untouched = snapshot(target)
    with (gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck,
          pytest.raises(gpusnap.IntegrityError, match=r"\(tensor x\)") as err):
        ck.restore(target, verify="upfront")
    assert bad in str(err.value) and "does not match its hash" in str(err.value)
    assert same(snapshot(target), untouched) == []  # upfront: nothing was written

    capsys.readouterr()
    assert cli_main(["verify", str(fast)]) == 1
    out = capsys.readouterr().out
    assert f"CORRUPT: checkpoint {info.id}" in out and bad in out, out
    assert cli_main(["verify", str(fast), info.id, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and len(doc["problems"]) == 1 and bad in doc["problems"][0]


def test_a_reader_of_a_deleted_checkpoint_whose_bytes_were_reused_gets_integrity_errors(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(1, width=128, extra=200_000)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, fast_keep_last=1) as ck:
        old = ck.save(state).wait()
        reader = FastTier.open(fast)  # another process's view: a plain reader of the root
        manifest = reader.load_manifest(old.id)
        names = [n for s in manifest.storages for n in s.chunks]
        original = {n: reader.read_chunk(n) for n in names}
        for step in range(2, 6):  # the old checkpoint is deleted; its bytes are taken again
            train(state, step)
            ck.save(state).wait()
        retained = Repository.open(fast).list()
        assert old.id not in {m.id for m in retained}
        overwritten = overlapping(manifest, retained)
        assert overwritten, "the test needs the old checkpoint's bytes reused (none were)"
        for name in names:
            try:
                data = reader.read_chunk(name)
            except gpusnap.IntegrityError as exc:
                assert "reused after its checkpoint was deleted" in str(exc)
                continue
            assert data == original[name], f"{name}: other bytes returned silently"
            assert name not in overwritten, f"{name}: its bytes were overwritten, yet it read as intact"


def test_verify_reports_a_missing_slab_a_short_slab_and_an_unreadable_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    durable, fast = roots(tmp_path)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, fast_keep_last=3) as ck:
        first = ck.save({"w": torch.arange(600_000.0), "step": 1}).wait()  # 2.4 MB: two slabs
        second = ck.save({"v": torch.arange(1000.0), "step": 2}).wait()
    assert cli_main(["verify", str(fast)]) == 0
    slabs = sorted({s for s, _o, _n in locations(Repository.open(fast).load_manifest(first.id))})
    assert len(slabs) == 2, slabs
    (fast / slab_path(slabs[1])).unlink()
    report = Repository.open(fast).verify()
    assert not report.ok and any(first.id in p for p in report.problems), report
    assert all("is missing: no slab" in p and p.endswith(slab_path(slabs[1])) for p in report.problems), report
    with open(fast / slab_path(slabs[0]), "r+b") as f:
        f.truncate(4096)
    report = Repository.open(fast).verify(first.id)
    assert any("holds 4096 bytes" in p for p in report.problems), report
    (fast / "manifests" / f"{second.id}.json").write_text("{not json")
    capsys.readouterr()
    assert cli_main(["verify", str(fast), second.id]) == 1
    assert f"{second.id}.json" in capsys.readouterr().out
    report = Repository.open(fast).verify()
    assert any(p.startswith("manifest ") and second.id in p for p in report.problems), report


def test_promoting_a_checkpoint_whose_slab_bytes_are_corrupt_is_refused(tmp_path: Path) -> None:
    from gpusnap.storage.promote import promote

    durable, fast = roots(tmp_path)
    state = make_state(1)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        info = ck.save(state).wait()
    bad = _chunk_of(fast, info.id, "x")
    _flip(fast, bad)
    tier = FastTier.open(fast)
    repo = Repository.open(durable, create=True, config=CFG)
    try:
        with pytest.raises(gpusnap.IntegrityError, match=bad.split("@")[0]):
            promote(tier, tier.load_manifest(info.id), repo)
    finally:
        repo.close()
    assert Repository.open(durable).list() == []  # never a durable copy of wrong bytes


def test_promotion_checks_back_to_back_chunks_in_one_pass_and_names_a_corrupt_one_inside_a_run(
        tmp_path: Path) -> None:
    from gpusnap.storage.promote import check_runs, promote

    durable, fast = roots(tmp_path)
    state = make_state(1)  # "x": 400 KB, seven 64 KiB chunks back to back, the last one shorter
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        info = ck.save(state).wait()
    tier = FastTier.open(fast)
    manifest = tier.load_manifest(info.id)
    chunks = list(manifest.storages[next(
        v for k, v in manifest.tree["items"] if k == {"t": "v", "v": "x"})["storage"]].chunks)
    assert len(chunks) == 7
    runs = check_runs(chunks, CFG.chunk_size)
    assert runs == [chunks[:6], chunks[6:]]  # the whole chunks in one run, the short tail alone
    assert check_runs(chunks, CFG.chunk_size, run_bytes=4 * CFG.chunk_size) == [chunks[:4], chunks[4:6], chunks[6:]]
    every = [n for e in manifest.storages for n in e.chunks]
    assert [n for run in check_runs(every, CFG.chunk_size) for n in run] == every  # order kept
    _flip(fast, chunks[3])
    repo = Repository.open(durable, create=True, config=CFG)
    try:
        with pytest.raises(gpusnap.IntegrityError, match=chunks[3].split("@")[0]):
            promote(tier, manifest, repo)
    finally:
        repo.close()
    assert Repository.open(durable).list() == []


def test_a_small_chunk_corrupt_in_its_slab_fails_the_promotion_and_commits_nothing(tmp_path: Path) -> None:
    from gpusnap.storage.promote import gather_small, promote

    durable, fast, tier, manifest, _runs = saved_for_promotion(tmp_path)
    gathered = gather_small([n for e in manifest.storages for n in e.chunks], CFG.chunk_size)[0]
    bad = gathered[len(gathered) // 2]
    _flip(fast, bad)
    repo = Repository.open(durable, create=True, config=CFG)
    try:
        with pytest.raises(gpusnap.IntegrityError, match=bad.split("@")[0]):
            promote(tier, manifest, repo)
    finally:
        repo.close()
    assert Repository.open(durable).list() == []


@pytest.mark.parametrize("corrupt", [None, 0, 3, -1])
def test_a_promotion_on_a_pool_checks_each_group_after_writing_it_and_commits_only_checked_bytes(
        tmp_path: Path, corrupt: int | None) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from gpusnap.storage import promote as promote_mod

    durable, fast, tier, manifest, runs = saved_for_promotion(tmp_path)
    every = [n for e in manifest.storages for n in e.chunks]
    if corrupt is not None:
        _flip(fast, runs[corrupt][0])
    checked: list[str] = []  # every chunk checked, in order
    read: list[str] = []  # the first chunk of each run read from the slab to be written
    check_bytes, run_view = tier.check_bytes, tier.run_view

    written: list[str] = []  # every chunk whose run was read to be written

    def checking(names: list[str], data: Any, chunk_size: int, device: object = None) -> None:
        assert set(names) <= set(written), "a group is checked once its runs are written"
        check_bytes(names, data, chunk_size, device)  # type: ignore[arg-type]
        checked.extend(names)

    def reading(names: list[str], chunk_size: int) -> memoryview:
        if not set(names) <= set(written):  # (a check reads the group again: not a write)
            read.append(names[0])
            written.extend(names)
        return run_view(names, chunk_size)

    tier.check_bytes = checking  # type: ignore[method-assign]
    tier.run_view = reading  # type: ignore[method-assign]
    repo = Repository.open(durable, create=True, config=CFG)
    pool = ThreadPoolExecutor(len(runs))  # (every run starts at once)
    try:
        if corrupt is None:
            promoted = promote_mod.promote(tier, manifest, repo, pool, workers=len(runs))
            gathered, rest = promote_mod.gather_small(every, CFG.chunk_size)
            assert gathered and checked == rest  # every byte not gathered, in order (gathered: checked in a copy)
            assert Repository.open(durable).list()[0].id == promoted.id
        else:
            bad = runs[corrupt][0]
            with pytest.raises(gpusnap.IntegrityError, match=bad.split("@")[0]):
                promote_mod.promote(tier, manifest, repo, pool, workers=len(runs))
            assert bad not in checked
            assert Repository.open(durable).list() == []  # never a durable copy of wrong bytes
    finally:
        pool.shutdown()
        repo.close()


def test_verify_during_saves_neither_holds_back_retention_nor_reports_a_retired_checkpoint(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(1, width=128, extra=200_000)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG, fast_keep_last=1) as ck:
        old = ck.save(state).wait()
        verifier = FastTier.open(fast)  # `gpusnap verify FASTROOT` from another process
        read_chunk = verifier.read_chunk
        newer: list[str] = []
        written = []  # the newer checkpoints' manifests (retention deletes all but the last)

        def saves_meanwhile(name: str, **kw: object) -> bytes:
            if not newer:  # while verify checks the old checkpoint, the writer goes on
                for step in range(2, 5):
                    train(state, step)
                    newer.append(ck.save(state).wait().id)
                    written.append(Repository.open(fast).load_manifest(newer[-1]))
            return read_chunk(name, **kw)  # type: ignore[arg-type]

        verifier.read_chunk = saves_meanwhile  # type: ignore[method-assign]
        old_manifest = verifier.load_manifest(old.id)
        report = verifier.verify(old.id)
        retained = Repository.open(fast).list()
        assert [m.id for m in retained] == newer[-1:], "retention waited for verify"
        assert overlapping(old_manifest, written), "the test needs the old checkpoint's bytes reused"
        assert report.ok, report  # its bytes were reused meanwhile: retired, not corrupt
        assert Repository.open(fast).verify().ok


def test_a_promotion_whose_run_fails_while_others_are_written_raises_it_and_commits_nothing(tmp_path: Path) -> None:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from gpusnap.storage import promote as promote_mod

    durable, _fast, tier, manifest, runs = saved_for_promotion(tmp_path)
    failing = tuple(runs[-1])  # (a later group's run: earlier groups are written and checked meanwhile)
    all_in_flight = threading.Barrier(len(runs))  # every run is being written when the last one fails
    to_write = {tuple(r) for r in runs}
    lock = threading.Lock()
    run_view = tier.run_view

    def reading(names: list[str], chunk_size: int) -> memoryview:
        with lock:
            writing = tuple(names) in to_write
            to_write.discard(tuple(names))  # (read again: a check of what was written)
        if writing:
            all_in_flight.wait(timeout=60)  # (a safety net against a hang, never reached when it works)
            if tuple(names) == failing:
                raise OSError(5, "the slab could not be read")
        return run_view(names, chunk_size)

    tier.run_view = reading  # type: ignore[method-assign]
    repo = Repository.open(durable, create=True, config=CFG)
    pool = ThreadPoolExecutor(len(runs))  # (every run starts at once)
    try:
        with pytest.raises(OSError, match="could not be read"):
            promote_mod.promote(tier, manifest, repo, pool, workers=len(runs))
        assert Repository.open(durable).list() == []
    finally:
        pool.shutdown()
        repo.close()
