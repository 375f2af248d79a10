"""Manifests round-trip exactly and refuse any flipped or missing byte."""

from __future__ import annotations

import json

import pytest

from gpusnap.errors import CheckpointError, IntegrityError
from gpusnap.storage.manifest import Manifest, StorageEntry


def _manifest(**overrides: object) -> Manifest:
    values: dict[str, object] = dict(
        id="20261130-052101-123-a1b2c3",
        tag="epoch-3",
        created=1764480061.1234567,
        chunk_size=512,
        storages=(
            StorageEntry(1000, "cuda:0", ("aa" * 16, "bb" * 16)),
            StorageEntry(7, "cpu", ("cc" * 16,)),
        ),
        tree={"t": "dict", "items": [[{"t": "v", "v": "lr"}, {"t": "v", "v": 0.1 + 0.2}]]},
        stats={"stall_s": 0.000123456789, "bytes_total": 1007, "validation": "ok"},
    )
    values.update(overrides)
    return Manifest(**values)  # type: ignore[arg-type]


def test_round_trip_is_exact_including_floats() -> None:
    m = _manifest()
    back = Manifest.from_json(m.to_json(), "x.json")
    assert back == m
    assert back.created == 1764480061.1234567
    assert back.tree["items"][0][1]["v"] == 0.1 + 0.2
    assert back.nbytes == 1007


def test_tag_none_and_empty_storages() -> None:
    m = _manifest(tag=None, storages=())
    back = Manifest.from_json(m.to_json(), "x.json")
    assert back.tag is None and back.storages == () and back.nbytes == 0


def test_file_carries_format_version_and_checksum() -> None:
    doc = json.loads(_manifest().to_json())
    assert doc["format"] == "gpusnap" and doc["version"] == 1
    assert len(doc["checksum"]) == 32


def test_no_flipped_byte_changes_what_is_read() -> None:
    original = _manifest()
    data = original.to_json()
    integrity = harmless = 0
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x01
        try:
            parsed = Manifest.from_json(bytes(bad), "manifests/m.json")
        except IntegrityError as exc:
            assert "manifests/m.json" in str(exc)
            integrity += 1
        except CheckpointError as exc:  # inside "format"/"version": reported as unknown format
            assert "manifests/m.json" in str(exc)
        else:
            # A digit past a float's precision parses to the same double: same manifest.
            assert parsed == original
            harmless += 1
    assert integrity >= len(data) - 40 and harmless <= 4


def test_every_truncation_is_an_integrity_error() -> None:
    data = _manifest().to_json()
    for n in range(len(data)):
        with pytest.raises(IntegrityError, match="where.json"):
            Manifest.from_json(data[:n], "where.json")


def test_unknown_version_is_not_called_corruption() -> None:
    from gpusnap.storage.manifest import READABLE_VERSIONS

    unknown = max(READABLE_VERSIONS) + 1
    doc = json.loads(_manifest().to_json())
    doc["version"] = unknown
    with pytest.raises(CheckpointError, match=f"version {unknown}") as info:
        Manifest.from_json(json.dumps(doc).encode(), "m.json")
    assert not isinstance(info.value, IntegrityError)


def test_edited_field_with_stale_checksum_is_refused() -> None:
    doc = json.loads(_manifest().to_json())
    doc["stats"]["bytes_total"] = 1
    with pytest.raises(IntegrityError, match="checksum"):
        Manifest.from_json(json.dumps(doc).encode(), "m.json")


def test_non_json_stats_are_rejected_on_write() -> None:
    with pytest.raises(CheckpointError, match="plain JSON"):
        _manifest(stats={"x": float("nan")}).to_json()


def test_the_checksum_spliced_in_front_is_the_canonical_json_of_the_whole() -> None:
    from gpusnap.storage.manifest import Manifest, StorageEntry, canonical_json, chunk_digest

    m = Manifest(id="20260101T000000000000Z-ab", tag="t", created=1.5, chunk_size=4,
                 storages=(StorageEntry(nbytes=4, device="cpu", chunks=("a" * 64,)),),
                 tree={"k": [1, "x"]}, stats={"b": 2.0, "a": None})
    body = m._body()
    assert m.to_json() == canonical_json({**body, "checksum": chunk_digest(canonical_json(body))})
    assert Manifest.from_json(m.to_json(), "here") == m
