"""Issue 21, A4: ``validate=False`` risks one checkpoint only. A write the tracker did not see
may reach that checkpoint (the documented risk), but the manifest never pairs a consistent-
point hash with the digest of other bytes, so no later incremental save reuses such a chunk
for bytes it does not hold."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gpusnap
from gpusnap.storage.repository import Repository

from capture_support import assert_bits, restored, tracked_config


def _state() -> dict[str, torch.Tensor]:
    return {"a": torch.randn(2048), "b": torch.randn(1024), "c": torch.arange(300, dtype=torch.int64)}


@pytest.mark.parametrize("second", ["same checkpointer", "new validating checkpointer"])
def test_an_unseen_write_without_validation_poisons_no_later_save(tmp_path: Any, gate: Any, second: str) -> None:
    state = _state()
    at_save = {k: v.clone() for k, v in state.items()}
    root = tmp_path / "ck"
    first = gpusnap.Checkpointer(root, config=tracked_config(validate=False))
    pending = first.save(state)
    state["b"].numpy()[7] = 1234.5  # unseen by the tracker, before "b" is copied
    gate.release()
    info1 = pending.wait(timeout=120)
    assert info1.stats["validation"].startswith("off")
    # the program puts the state at save() back: the next save's hashes equal the first's
    state["b"].copy_(at_save["b"])
    if second == "same checkpointer":
        ck = first
    else:  # (one writer per root: the first one goes first)
        first.close()
        ck = gpusnap.Checkpointer(root, config=tracked_config())
    with ck:
        info2 = ck.save(state).wait(timeout=120)
        assert_bits(restored(ck, at_save, info2.id), at_save)  # the state at the second save()
    first.close()
    # the unvalidated checkpoint records no device hash for what it copied from live memory,
    # so neither the next save nor a restore's device check trusts one
    manifest = Repository.open(root, create=False).load_manifest(info1.id)
    assert all(entry.hashes is None for entry in manifest.storages)


def test_an_unvalidated_checkpoint_still_restores_what_it_stored(tmp_path: Any, gate: Any) -> None:
    """The risk itself is unchanged (the unseen write is in that checkpoint), and its restore,
    checked by digests, succeeds."""
    state = _state()
    with gpusnap.Checkpointer(tmp_path / "ck", config=tracked_config(validate=False,
                                                                     restore_verify_on_device="on")) as ck:
        pending = ck.save(state)
        state["b"].numpy()[7] = 1234.5
        gate.release()
        info = pending.wait(timeout=120)
        got = restored(ck, state, info.id)
    assert got["b"][7].item() == 1234.5


def test_snapshots_without_validation_keep_their_hashes_and_skip_unchanged_chunks(tmp_path: Any) -> None:
    """Bytes copied at save() are the hashed bytes: such saves stay incremental."""
    state = _state()
    config = tracked_config(validate=False, cpu_snapshot_bytes=1 << 20)
    with gpusnap.Checkpointer(tmp_path / "ck", config=config) as ck:
        ck.save(state).wait(timeout=120)
        info = ck.save(state).wait(timeout=120)
    assert info.stats["bytes_skipped"] == info.stats["bytes_total"]
    manifest = Repository.open(tmp_path / "ck", create=False).load_manifest(info.id)
    assert all(entry.hashes is not None for entry in manifest.storages)


def test_unchanged_spans_of_an_unvalidated_window_keep_their_hashes(tmp_path: Any) -> None:
    """A span whose every chunk was skipped as stored (frozen weights) keeps its hashes even
    without validation: they describe bytes stored by an earlier, trusted checkpoint."""
    state = _state()
    with gpusnap.Checkpointer(tmp_path / "ck", config=tracked_config()) as ck:
        ck.save(state).wait(timeout=120)  # validated: its hashes are trusted
    state["a"].add_(1.0)
    with gpusnap.Checkpointer(tmp_path / "ck", config=tracked_config(validate=False)) as ck:
        info = ck.save(state).wait(timeout=120)
    manifest = Repository.open(tmp_path / "ck", create=False).load_manifest(info.id)
    by_size = {entry.nbytes: entry for entry in manifest.storages}
    assert by_size[2048 * 4].hashes is None  # "a" changed: copied live, unvalidated
    assert by_size[1024 * 4].hashes is not None and by_size[300 * 8].hashes is not None
