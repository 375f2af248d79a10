"""Flipped bytes, truncated manifests and malicious payloads are reported, never trusted."""

from __future__ import annotations

import base64
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

import gpusnap
from gpusnap import Config, IntegrityError
from gpusnap.cli.main import main as cli_main
from gpusnap.kernels.hashing import chunk_digest

CFG = Config(chunk_size=4096, pack_size=1 << 20, io_threads=2, staging_bytes=4096)


def _packs(root: Path) -> set[Path]:
    return set((root / "packs").rglob("*.pack"))


def _two_checkpoints(root: Path) -> tuple[str, str, set[Path]]:
    with gpusnap.Checkpointer(root, config=CFG) as ck:
        a = ck.save({"t": torch.full((4096,), 1.0)}, blocking=True).wait().id
        before = _packs(root)
        b = ck.save({"t": torch.full((4096,), 2.0)}, blocking=True).wait().id
    return a, b, _packs(root) - before


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_flipped_byte_in_pack_is_reported_by_verify_and_restore(tmp_path, capsys):
    root = tmp_path / "ck"
    a, b, b_packs = _two_checkpoints(root)
    assert b_packs, "the second checkpoint wrote packs of its own"
    pack = sorted(b_packs)[0]
    _flip(pack, 8 + 100)  # inside the first chunk's bytes
    assert cli_main(["verify", str(root)]) == 1
    assert "CORRUPT" in capsys.readouterr().out
    assert cli_main(["verify", str(root), a]) == 0
    t = torch.zeros(4096)
    with gpusnap.Checkpointer(root, config=CFG) as ck:
        with pytest.raises(IntegrityError) as err:
            ck.restore({"t": t}, b)
        assert "t" in str(err.value) and pack.name in str(err.value)
        assert torch.equal(t, torch.zeros(4096)), "nothing applied from a corrupt checkpoint"
        ck.restore({"t": t}, a)
    assert torch.equal(t, torch.full((4096,), 1.0))


@pytest.mark.parametrize("where", ["start", "middle", "footer"])
def test_any_flipped_pack_byte_is_caught_by_verify(tmp_path, where):
    root = tmp_path / "ck"
    _a, _b, b_packs = _two_checkpoints(root)
    pack = sorted(b_packs)[0]
    size = pack.stat().st_size
    offset = {"start": 2, "middle": size // 2, "footer": size - 20}[where]
    _flip(pack, offset)
    assert cli_main(["verify", str(root)]) == 1


def test_truncated_manifest_is_reported_and_others_restore(tmp_path, capsys):
    root = tmp_path / "ck"
    a, b, _ = _two_checkpoints(root)
    manifest = root / "manifests" / f"{b}.json"
    manifest.write_bytes(manifest.read_bytes()[: manifest.stat().st_size // 2])
    assert cli_main(["verify", str(root)]) == 1
    assert cli_main(["ls", str(root)]) == 1  # lists the rest, marks the damage
    out = capsys.readouterr().out
    assert a in out and "unreadable" in out
    t = torch.zeros(4096)
    with gpusnap.Checkpointer(root, config=CFG) as ck:
        assert [i.id for i in ck.list()] == [a]
        ck.restore({"t": t}, a)
        assert torch.equal(t, torch.full((4096,), 1.0))
        with pytest.raises(gpusnap.CheckpointError):
            ck.restore({"t": t}, b)


def test_flipped_byte_in_manifest_is_caught(tmp_path):
    root = tmp_path / "ck"
    a, b, _ = _two_checkpoints(root)
    manifest = root / "manifests" / f"{b}.json"
    text = manifest.read_bytes()
    i = text.index(b'"step"') if b'"step"' in text else len(text) // 2
    _flip(manifest, i + 2)
    assert cli_main(["verify", str(root)]) == 1
    with gpusnap.Checkpointer(root) as ck:
        assert [i.id for i in ck.list()] == [a]


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch BOOM_MARKER",))


def _rewrite_manifest(path: Path, mutate) -> None:
    """Edit a manifest and re-seal its checksum, as an attacker with write access could."""
    doc = json.loads(path.read_bytes())
    doc.pop("checksum")
    mutate(doc)
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    doc["checksum"] = chunk_digest(body)
    path.write_bytes(json.dumps(doc).encode())


def test_malicious_pickle_payload_is_not_executed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "ck"
    with gpusnap.Checkpointer(root) as ck:
        cid = ck.save({"t": torch.ones(3), "cfg": "plain"}, blocking=True).wait().id
    payload = base64.b64encode(pickle.dumps(_Boom())).decode()

    def plant(doc):
        for item in doc["tree"]["items"]:
            if item[1].get("t") == "v" and item[1].get("v") == "plain":
                item[1].clear()
                item[1].update({"t": "pickle", "v": payload})

    _rewrite_manifest(root / "manifests" / f"{cid}.json", plant)
    app = {"t": torch.zeros(3), "cfg": None}
    with gpusnap.Checkpointer(root) as ck:
        with pytest.raises(gpusnap.CheckpointError, match="allow_pickle"):
            ck.restore(app)
    assert not (tmp_path / "BOOM_MARKER").exists()
    assert cli_main(["show", str(root)]) == 0  # show never unpickles either
    assert not (tmp_path / "BOOM_MARKER").exists()
    assert torch.equal(app["t"], torch.zeros(3)), "refused before any byte was written"
