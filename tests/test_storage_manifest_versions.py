"""Which manifest version is written, which are read: a distributed checkpoint's global
manifest is DISTRIBUTED_VERSION (a gpusnap that predates it would list it as an empty
checkpoint), every other manifest VERSION; an unknown version is refused, never misread."""

from __future__ import annotations

import json

import pytest

from gpusnap.errors import CheckpointError, IntegrityError
from gpusnap.kernels.hashing import chunk_digest
from gpusnap.storage.manifest import (
    DEVICE_NAMED_VERSION,
    DISTRIBUTED_VERSION,
    READABLE_VERSIONS,
    VERSION,
    Manifest,
    RankPart,
    StorageEntry,
    canonical_json,
)


def _manifest(**overrides: object) -> Manifest:
    values: dict[str, object] = dict(id="20261202-101010-000-abcdef-000001", tag="step3", created=1764670210.5,
                                     chunk_size=512, storages=(StorageEntry(7, "cpu", ("cc" * 16,)),),
                                     tree={"t": "dict", "items": []}, stats={})
    values.update(overrides)
    return Manifest(**values)  # type: ignore[arg-type]


def _global() -> Manifest:
    return _manifest(storages=(), tree={"t": "ranks"},
                     ranks=(RankPart(0, "aa" * 16, 10), RankPart(1, "bb" * 16, 12)))


def _rewritten(doc: dict[str, object]) -> bytes:
    """``doc`` as a writer of its version would store it (a valid checksum)."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return canonical_json({**body, "checksum": chunk_digest(canonical_json(body))})


def test_a_global_manifest_is_written_as_the_distributed_version_and_reads_back() -> None:
    assert DISTRIBUTED_VERSION != VERSION and set(READABLE_VERSIONS) >= {VERSION, DISTRIBUTED_VERSION}
    m = _global()
    assert json.loads(m.to_json())["version"] == DISTRIBUTED_VERSION
    back = Manifest.from_json(m.to_json(), "manifests/g.json")
    assert back == m and back.world_size == 2 and back.nbytes == 22
    assert back.checksum == m.checksum  # (what a reader compares; the version is inside it)


def test_every_other_manifest_keeps_the_first_version() -> None:
    """Per-process manifests and ranks' parts (DTensor nodes included) stay readable as before."""
    dtensor_part = _manifest(tree={"t": "dict", "items": [[{"t": "v", "v": "w"}, {"t": "dtensor", "local": None}]]})
    for m in (_manifest(), dtensor_part):
        assert json.loads(m.to_json())["version"] == VERSION


def test_a_global_manifest_of_the_first_version_is_still_read() -> None:
    """Written before the distributed version existed: the same fields under version 1."""
    doc = json.loads(_global().to_json())
    doc["version"] = VERSION
    back = Manifest.from_json(_rewritten(doc), "manifests/old.json")
    assert back.ranks == _global().ranks and back.world_size == 2


def test_an_unknown_newer_version_is_refused_with_what_to_do() -> None:
    newer = max(READABLE_VERSIONS) + 1
    for m in (_manifest(), _global()):
        doc = json.loads(m.to_json())
        doc["version"] = newer
        with pytest.raises(CheckpointError, match=rf"version {newer}; this gpusnap reads 'gpusnap' versions "
                                                  rf"{VERSION}, .*{DEVICE_NAMED_VERSION} \(upgrade gpusnap") as info:
            Manifest.from_json(_rewritten(doc), "manifests/new.json")
        assert not isinstance(info.value, IntegrityError)  # (not corruption: a newer writer)


def test_the_version_is_covered_by_the_checksum() -> None:
    doc = json.loads(_global().to_json())
    doc["version"] = VERSION  # changed without a new checksum: tampering, not an older writer
    with pytest.raises(IntegrityError, match="fails its checksum"):
        Manifest.from_json(json.dumps(doc).encode(), "manifests/g.json")


def test_device_named_chunks_need_version_4_and_a_well_formed_name() -> None:
    from gpusnap.storage.manifest import StorageEntry

    named = StorageEntry(4, "cpu", ("nh:" + "0" * 32,), ("0" * 32,))
    m = Manifest(id="20261206-000000-000-000000", tag=None, created=1.0, chunk_size=512, storages=(named,),
                 tree={}, stats={})
    assert m.version == DEVICE_NAMED_VERSION
    assert Manifest.from_json(m.to_json(), "m").storages[0].chunks == named.chunks
    for version, chunk in ((VERSION, "nh:" + "0" * 32), (DEVICE_NAMED_VERSION, "nh:xyz")):
        doc = json.loads(m.to_json())
        doc["version"], doc["storages"][0]["chunks"] = version, [chunk]
        with pytest.raises(CheckpointError, match="malformed"):
            Manifest.from_json(_rewritten(doc), "manifests/m.json")
