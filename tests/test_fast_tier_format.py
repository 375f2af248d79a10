"""The fast tier's compact manifest (format version 2, storage/fast_chunks.py): its record
and encoding against the plain ones, and manifests of version 1 (a fixture written by the
code that wrote that format, tests/data/make_fast_v1.py) still restored, verified, listed,
collected, promoted and built upon."""

from __future__ import annotations

import json
import pickle
import random
import sys
import tarfile
from pathlib import Path

import pytest
import torch

import gpusnap
from gpusnap.cli.main import main
from gpusnap.errors import CheckpointError
from gpusnap.storage.canonical import TreeCodes, canonical_json
from gpusnap.storage.fast_chunks import FastChunks, merged_ranges, span_runs
from gpusnap.storage.fast_tier import FastTier, _merge, chunk_location
from gpusnap.storage.manifest import DEVICE_NAMED_VERSION, FAST_VERSION, VERSION, Manifest, StorageEntry

DATA = Path(__file__).parent / "data"
sys.path.insert(0, str(DATA))
from make_fast_v1 import CFG as V1_CFG  # noqa: E402
from make_fast_v1 import v1_state  # noqa: E402

H = [f"{k:032x}" for k in range(1, 40)]


def _record(runs: tuple, nbytes: int, cs: int = 1024) -> FastChunks:
    n = -(-nbytes // cs)
    return FastChunks(tuple(H[:n]), runs, nbytes=nbytes, chunk_size=cs).check()


def test_a_record_names_its_chunks_as_the_version_1_names_did() -> None:
    c = _record(((2, 8192, 2), (0, 0, 1)), 2600)
    assert list(c) == [f"{H[0]}@2:8192:1024", f"{H[1]}@2:9216:1024", f"{H[2]}@0:0:552"]
    assert [c[k] for k in range(3)] == list(c) and c[-1] == list(c)[-1] and c[1:] == tuple(c)[1:]
    assert FastChunks(c.hashes, c.runs, nbytes=2600, chunk_size=1024).name(2) == f"{H[2]}@0:0:552"
    assert c == tuple(c) and tuple(c) == c and hash(c) == hash(tuple(c))
    assert chunk_location(c[2]) == (H[2], 0, 0, 552)
    assert c.ranges() == [(2, 8192, 10240), (0, 0, 552)]
    assert pickle.loads(pickle.dumps(c)) == c


@pytest.mark.parametrize("runs, nbytes", [(((0, 0, 2),), 3000), (((0, 0, 3),), 2048), (((0, -1, 2),), 2048),
                                          (((0, 0, 0), (0, 0, 2)), 2048)])
def test_an_inconsistent_record_is_refused(runs: tuple, nbytes: int) -> None:
    with pytest.raises(ValueError):
        FastChunks(tuple(H[:2]), runs, nbytes=nbytes, chunk_size=1024).check()


def test_runs_and_merged_ranges_match_what_per_chunk_names_give() -> None:
    rng = random.Random(7)
    for _ in range(200):
        cs = rng.choice([512, 1024, 4096])
        sizes = [rng.choice([0, rng.randint(1, 6 * cs)]) for _ in range(rng.randint(1, 8))]
        counts = [-(-n // cs) for n in sizes]
        first = [sum(counts[:i]) for i in range(len(counts))]
        slabs = torch.tensor([rng.randint(0, 2) for _ in range(sum(counts))], dtype=torch.int64).numpy()
        offsets = torch.tensor([rng.choice([0, 1, 2, 3, 5]) * cs + rng.choice([0, 0, 512]) for _ in slabs],
                               dtype=torch.int64).numpy()
        for i in range(1, len(offsets)):  # some chunks follow their predecessor, so runs form
            if rng.random() < 0.6:
                slabs[i], offsets[i] = slabs[i - 1], offsets[i - 1] + cs
        records = [FastChunks(tuple(f"{g:032x}" for g in range(f, f + c)), r, nbytes=n, chunk_size=cs).check()
                   for f, c, n, r in zip(first, counts, sizes, span_runs(slabs, offsets, first, counts, cs))]
        want_names, used = [], {}
        for f, c, n in zip(first, counts, sizes):
            for k in range(c):
                g, size = f + k, min(cs, n - k * cs)
                want_names.append(f"{g:032x}@{slabs[g]}:{offsets[g]}:{size}")
                used.setdefault(int(slabs[g]), []).append((int(offsets[g]), int(offsets[g]) + size))
        assert [name for r in records for name in r] == want_names
        assert merged_ranges(records) == {s: _merge(r) for s, r in used.items()}


def test_tree_codes_give_canonical_json_and_encode_again_what_is_new() -> None:
    leaf = {"t": "tensor", "shape": (2, 3), "stride": (3, 1), "dtype": "float32"}
    tree = {"t": "dict", "items": [[{"t": "v", "v": "w"}, leaf]], "odd": {1: "int key"}, "x": ["é", 1.5, None]}
    codes = TreeCodes()
    assert codes.encode(tree) == canonical_json(tree).decode()
    again = {**tree, "items": [[{"t": "v", "v": "w"}, leaf], [{"t": "v", "v": "b"}, dict(leaf, shape=(4,))]]}
    assert codes.encode(again) == canonical_json(again).decode()  # the leaf from memory, the new one encoded


def _manifest(storages: tuple, chunk_size: int = 1024) -> Manifest:
    return Manifest(id="20260101-000000-000-abcdef", tag="t", created=1.0, chunk_size=chunk_size, storages=storages,
                    tree={"t": "dict", "items": []}, stats={"a": 1})


def test_a_fast_manifest_is_version_2_and_round_trips() -> None:
    c = _record(((1, 4096, 3),), 2600)
    m = _manifest((StorageEntry(2600, "cpu", c, c.hashes), StorageEntry(0, "cpu", ())))
    data = m.to_json(TreeCodes())
    doc = json.loads(data)
    assert doc["version"] == FAST_VERSION and doc["storages"][0] == {
        "nbytes": 2600, "device": "cpu", "runs": [[1, 4096, 3]], "hashes": "".join(H[:3])}
    assert data == canonical_json({**m._body(), "checksum": m.checksum})
    back = Manifest.from_json(data, "m.json")
    assert back == m and back.checksum == m.checksum and isinstance(back.storages[0].chunks, FastChunks)
    assert back.storages[0].hashes == c.hashes and back.version == FAST_VERSION
    plain = _manifest((StorageEntry(2600, "cpu", ("d" * 64,) * 3, c.hashes),))
    assert json.loads(plain.to_json())["version"] == VERSION  # (durable manifests keep version 1)


@pytest.mark.parametrize("edit", ["count", "hex", "version 1", "both"])
def test_a_malformed_fast_record_is_refused(edit: str) -> None:
    c = _record(((1, 4096, 3),), 2600)
    doc = json.loads(_manifest((StorageEntry(2600, "cpu", c, c.hashes),)).to_json())
    entry = doc["storages"][0]
    if edit == "count":
        entry["runs"] = [[1, 4096, 2]]
    elif edit == "hex":
        entry["hashes"] = entry["hashes"][:-1] + "Z"
    elif edit == "version 1":
        doc["version"] = VERSION
    else:
        entry["chunks"] = []
    doc.pop("checksum")
    doc["checksum"] = Manifest.from_json.__globals__["chunk_digest"](canonical_json(doc))
    with pytest.raises(CheckpointError, match="malformed"):
        Manifest.from_json(json.dumps(doc).encode(), "m.json")


def test_a_record_that_disagrees_with_its_entry_is_not_written() -> None:
    c = _record(((1, 4096, 3),), 2600)
    with pytest.raises(CheckpointError, match="record"):
        _manifest((StorageEntry(2600, "cpu", c, None),)).to_json()
    with pytest.raises(CheckpointError, match="record"):
        _manifest((StorageEntry(2600, "cpu", c, c.hashes),), chunk_size=512).to_json()


@pytest.fixture
def v1_root(tmp_path: Path) -> Path:
    with tarfile.open(DATA / "fast_v1.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    return tmp_path / "fast"


def _versions(fast: Path) -> list[int]:
    return sorted(json.loads(p.read_bytes())["version"] for p in (fast / "manifests").glob("*.json"))


def _equal(a: dict, b: dict) -> bool:
    return a["step"] == b["step"] and all(torch.equal(a[k], b[k]) for k in ("w", "b"))


def test_version_1_fast_manifests_restore_verify_and_list(v1_root: Path, tmp_path: Path, capsys) -> None:
    assert _versions(v1_root) == [VERSION, VERSION]
    tier = FastTier.open(v1_root)
    report = tier.verify()
    assert report.ok and report.checked_checkpoints == 2 and report.checked_chunks > 0, report.problems
    with gpusnap.Checkpointer(tmp_path / "durable", fast_root=v1_root, config=gpusnap.Config(**V1_CFG)) as ck:
        assert [i.tag for i in ck.list()] == ["one", "two"] and {i.tier for i in ck.list()} == {"fast"}
        for tag, step in (("one", 1), ("two", 2)):
            target = {"w": torch.zeros(3000), "b": torch.zeros(700, dtype=torch.float64), "step": 0}
            ck.restore(target, tag)
            assert _equal(target, v1_state(step))
    assert main(["verify", str(v1_root)]) == 0
    assert main(["ls", str(v1_root)]) == 0 and "two" in capsys.readouterr().out


def test_a_new_save_on_a_version_1_tier_reuses_its_chunks_keeps_its_bytes_and_promotes(v1_root: Path,
                                                                                       tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    with gpusnap.Checkpointer(durable, fast_root=v1_root, fast_keep_last=2, config=gpusnap.Config(**V1_CFG)) as ck:
        ck.restore({"w": torch.zeros(3000), "b": torch.zeros(700, dtype=torch.float64), "step": 0})
        info = ck.save(v1_state(3), tag="three", promote=True).wait()
        ck.wait()
        assert info.stats["bytes_skipped"] > 0  # ``w`` is the version 1 checkpoints' chunks again
        assert _versions(v1_root) == [VERSION, FAST_VERSION]  # retention dropped "one"
        assert [i.tag for i in ck.list()] == ["two", "three"]
        for tag, step in (("two", 2), ("three", 3)):  # neither save's bytes were reused by the other
            target = {"w": torch.zeros(3000), "b": torch.zeros(700, dtype=torch.float64), "step": 0}
            ck.restore(target, tag)
            assert _equal(target, v1_state(step))
        assert FastTier.open(v1_root).verify().ok
    promoted = gpusnap.Checkpointer(durable)
    target = {"w": torch.zeros(3000), "b": torch.zeros(700, dtype=torch.float64), "step": 0}
    promoted.restore(target, "three")
    assert _equal(target, v1_state(3)) and promoted.list()[-1].tier == "durable"
    # chunks named by their device hash: a gpusnap that predates that refuses it, never misreads it
    assert _versions(durable) == [DEVICE_NAMED_VERSION]
    promoted.close()
    assert main(["gc", str(v1_root), "--keep-last", "1"]) == 0
    assert _versions(v1_root) == [FAST_VERSION] and FastTier.open(v1_root).verify().ok


def test_the_ranges_a_save_placed_are_those_its_manifest_names(tmp_path: Path) -> None:
    from fast_support import CFG, make_state, train

    from gpusnap.storage.fast_tier import _add_ranges

    state = make_state(1)
    with gpusnap.Checkpointer(tmp_path / "durable", fast_root=tmp_path / "fast", config=CFG) as ck:
        for step in (2, 3, 4):  # (the second reuses the first's unchanged chunks: ranges of two saves)
            if step > 2:
                train(state, step)
            info = ck.save(state).wait()
            tier = ck._tiers.fast()
            manifest = tier.resolve(info.id)
            parsed: dict[int, list[tuple[int, int]]] = {}
            _add_ranges(parsed, manifest)
            assert tier._ranges[info.id][1] == {s: _merge(r) for s, r in parsed.items()}
            assert tier._ranges[info.id][0] is manifest
