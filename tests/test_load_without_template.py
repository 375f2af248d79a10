"""``gpusnap.load``: a checkpoint's nested dict without a template (DESIGN.md, "Interop").

Round trips against the state_dicts saved, bit for bit (dtypes, shapes, strides, shared
storages); ``keys`` reading only the selected entries' chunks; fast-tier roots; integrity,
pickle refusal, id/tag selection and the errors a user meets.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from fast_support import CFG, make_state, roots, same, snapshot
from restore_support import corrupt_chunk, tiny_config
from torch import nn

import gpusnap
from gpusnap.restore.template_free import UnknownKeyError
from gpusnap.storage.repository import Repository


class _Tied(nn.Module):
    """Embedding and head share one weight; a bfloat16 buffer and a transposed (strided) one."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.randn(5, 3).to(torch.bfloat16))
        self.register_buffer("mixed_t", torch.randn(4, 6).t())


def _app_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Tied()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.head(model.mid(model.emb(torch.arange(6)))).square().sum().backward()
    optim.step()
    base = torch.randn(6, 10)
    return {
        "model": model,
        "optim": optim,
        "rng": gpusnap.RNGState(),
        "views": {"base": base, "t": base.t(), "cols": base[:, 2:7:2], "row": base[3]},
        "dtypes": [torch.randn(7).half(), torch.arange(-5, 5, dtype=torch.int8), torch.rand(9) > 0.5,
                   torch.randn(3, dtype=torch.complex64), torch.randn(4, dtype=torch.float64)],
        "step": 7,
        "lr": 0.25,
        "name": "run",
        "blob": b"\x00\x01",
        "none": None,
        "cfg": {"depth": 2, "sizes": [1, 2, 3], "pair": (1, "a")},
    }


def _expected(app_state: dict[str, Any]) -> dict[str, Any]:
    """What a save at this moment holds, state_dicts for the objects (``fast_support.snapshot``)."""
    return snapshot(app_state | {"rng": app_state["rng"].state_dict()})


def _save(root: Path, app_state: dict[str, Any], **kwargs: Any) -> gpusnap.CheckpointInfo:
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        return ck.save(app_state, blocking=True, **kwargs).wait()


def _storage_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_round_trip_equals_the_state_dicts_bit_exactly(tmp_path: Path) -> None:
    state = _app_state()
    expected = _expected(state)
    _save(tmp_path, state)
    loaded = gpusnap.load(tmp_path)
    assert list(loaded) == list(state)
    assert same(snapshot(loaded), expected) == []
    model = loaded["model"]
    assert set(model) == set(state["model"].state_dict())
    assert model["scale"].dtype == torch.bfloat16
    assert model["mixed_t"].stride() == state["model"].mixed_t.stride()
    assert not model["mid.weight"].requires_grad  # as state_dict() gives them
    optim = loaded["optim"]
    assert optim["param_groups"] == state["optim"].state_dict()["param_groups"]
    assert set(optim["state"]) == set(state["optim"].state_dict()["state"])
    assert loaded["cfg"] == state["cfg"] and isinstance(loaded["cfg"]["pair"], tuple)
    for key in ("step", "lr", "name", "blob", "none"):
        assert loaded[key] == state[key] and type(loaded[key]) is type(state[key])


def test_views_and_tied_weights_come_back_sharing_storage(tmp_path: Path) -> None:
    state = _app_state()
    _save(tmp_path, state)
    loaded = gpusnap.load(tmp_path, device=torch.device("cpu"))
    model, views = loaded["model"], loaded["views"]
    assert _storage_of(model["emb.weight"]) == _storage_of(model["head.weight"])
    assert model["emb.weight"].data_ptr() == model["head.weight"].data_ptr()
    base = views["base"]
    for name in ("t", "cols", "row"):
        original = state["views"][name]
        got = views[name]
        assert _storage_of(got) == _storage_of(base), name
        assert (got.shape, got.stride(), got.storage_offset()) == (
            original.shape, original.stride(), original.storage_offset()), name
        assert torch.equal(got, original), name
    base.fill_(1.0)  # one storage: a write through the base shows in every view
    assert torch.equal(views["cols"], torch.ones_like(views["cols"]))


def _spans_under(tree: dict[str, Any], key: str) -> set[int]:
    """Storage indices of every tensor node below the tree's top-level ``key``."""
    found: set[int] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("t") == "tensor":
                found.add(node["storage"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for key_node, value in tree["items"]:
        if key_node.get("v") == key:
            walk(value)
    return found


def test_keys_model_reads_only_the_model_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _app_state()
    expected = _expected(state)
    _save(tmp_path, state)
    manifest = Repository.open(tmp_path).resolve(None)
    model_spans = _spans_under(manifest.tree, "model")
    model_chunks = [d for i in sorted(model_spans) for d in manifest.storages[i].chunks]
    assert 0 < len(model_chunks) < sum(len(s.chunks) for s in manifest.storages)

    read: list[str] = []
    original = Repository.read_chunks_into

    def counting(self: Repository, digests: Any, *args: Any, **kwargs: Any) -> Any:
        read.extend(digests)
        return original(self, digests, *args, **kwargs)

    monkeypatch.setattr(Repository, "read_chunks_into", counting)
    loaded = gpusnap.load(tmp_path, keys=["model"])
    assert list(loaded) == ["model"]
    assert sorted(read) == sorted(model_chunks)
    assert same(snapshot(loaded), {k: v for k, v in expected.items() if k.startswith("model/")}) == []


def test_dotted_keys_select_inside_state_dicts(tmp_path: Path) -> None:
    state = _app_state()
    _save(tmp_path, state)
    loaded = gpusnap.load(tmp_path, keys=["optim.state", "model.mid.weight", "views/t", "cfg.depth"])
    assert set(loaded) == {"optim", "model", "views", "cfg"}
    assert list(loaded["optim"]) == ["state"]
    assert set(loaded["optim"]["state"]) == set(state["optim"].state_dict()["state"])
    assert list(loaded["model"]) == ["mid.weight"]  # not mid.bias: a prefix ends at a key boundary
    assert torch.equal(loaded["model"]["mid.weight"], state["model"].mid.weight)
    assert list(loaded["views"]) == ["t"] and torch.equal(loaded["views"]["t"], state["views"]["t"])
    assert loaded["cfg"] == {"depth": 2}


def test_an_unknown_key_names_the_top_level_keys(tmp_path: Path) -> None:
    _save(tmp_path, {"model": nn.Linear(2, 2), "step": 1})
    for keys in (["modle"], ["model", "model.nope"]):
        with pytest.raises(UnknownKeyError) as caught:
            gpusnap.load(tmp_path, keys=keys)
        assert isinstance(caught.value, KeyError) and isinstance(caught.value, gpusnap.CheckpointError)
        assert keys[-1] in str(caught.value) and "['model', 'step']" in str(caught.value)
    with pytest.raises(ValueError):
        gpusnap.load(tmp_path, keys=[""])


def test_load_from_a_fast_tier_root(tmp_path: Path) -> None:
    durable, fast = roots(tmp_path)
    state = make_state(3)
    expected = snapshot(state)
    with gpusnap.Checkpointer(durable, fast_root=fast, config=CFG) as ck:
        info = ck.save(state).wait()
    assert info.tier == "fast"
    assert same(snapshot(gpusnap.load(fast)), expected) == []
    assert same(snapshot(gpusnap.load(fast, info.id, keys=["model"])),
                {k: v for k, v in expected.items() if k.startswith("model/")}) == []


def test_a_corrupt_chunk_raises_integrity_error(tmp_path: Path) -> None:
    marked = torch.arange(4096, dtype=torch.float32)
    _save(tmp_path, {"marked": marked, "other": torch.ones(300), "step": 1})
    corrupt_chunk(tmp_path, marked[:64].numpy().tobytes(), at=100)
    with pytest.raises(gpusnap.IntegrityError, match="marked"):
        gpusnap.load(tmp_path)
    with pytest.raises(gpusnap.IntegrityError):
        gpusnap.load(tmp_path, keys=["marked"])
    clean = gpusnap.load(tmp_path, keys=["other", "step"])  # its chunks are never read
    assert torch.equal(clean["other"], torch.ones(300)) and clean["step"] == 1


def test_a_pickled_value_is_refused_without_allow_pickle(tmp_path: Path) -> None:
    with gpusnap.Checkpointer(tmp_path, allow_pickle=True, config=tiny_config()) as ck:
        ck.save({"frac": Fraction(1, 3), "w": torch.ones(3)}, blocking=True).wait()
    with pytest.raises(gpusnap.CheckpointError, match="allow_pickle"):
        gpusnap.load(tmp_path)
    assert torch.equal(gpusnap.load(tmp_path, keys=["w"])["w"], torch.ones(3))  # no pickle selected
    assert gpusnap.load(tmp_path, allow_pickle=True)["frac"] == Fraction(1, 3)


def test_checkpoint_by_id_by_tag_and_latest(tmp_path: Path) -> None:
    first = _save(tmp_path, {"w": torch.zeros(4), "step": 1}, tag="first")
    second = _save(tmp_path, {"w": torch.ones(4), "step": 2}, tag="second")
    assert gpusnap.load(tmp_path)["step"] == 2
    assert gpusnap.load(tmp_path, "first")["step"] == 1
    assert gpusnap.load(tmp_path, first.id)["step"] == 1
    assert torch.equal(gpusnap.load(tmp_path, second.id)["w"], torch.ones(4))
    with pytest.raises(gpusnap.CheckpointNotFoundError):
        gpusnap.load(tmp_path, "third")
    with pytest.raises(gpusnap.CheckpointNotFoundError):
        gpusnap.load(tmp_path / "nowhere")
