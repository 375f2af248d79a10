"""flatten(..., plan=): the previous walk's per-tensor work is reused only when every tensor
is laid out as before; the result always equals a full flatten."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

import gpusnap
from gpusnap.state.flatten import FlatState, flatten


def _app() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    model[2].weight = nn.Parameter(torch.randn(4, 16))  # a fresh storage
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    view_base = torch.arange(64.0)
    views = [view_base[:16], view_base[8:40].view(4, 8)]
    return {"model": model, "optim": optim, "views": views, "rng": gpusnap.RNGState(), "step": 3}


def _same(a: FlatState, b: FlatState) -> None:
    """Equal trees (as written to the manifest) and equal spans."""
    assert json.dumps(a.tree, sort_keys=True, default=list) == json.dumps(b.tree, sort_keys=True, default=list)
    assert len(a.spans) == len(b.spans)
    for x, y in zip(a.spans, b.spans):
        assert (x.index, x.device, x.start, x.end, x.paths) == (y.index, y.device, y.start, y.end, y.paths)
        if x.paths[0].startswith("rng/"):  # RNGState hands out new tensors per call
            continue
        assert x.storage._cdata == y.storage._cdata
        assert [id(t) for t in x.tensors] == [id(t) for t in y.tensors]


def test_an_unchanged_state_reuses_the_plan_and_equals_a_full_walk() -> None:
    app = _app()
    first = flatten(app)
    again = flatten(app, plan=first.plan)
    assert not first.planned and again.planned
    _same(again, flatten(app))
    assert again.plan is first.plan


def test_fresh_tensors_from_a_state_dict_still_match_the_plan() -> None:
    """RNGState hands out new tensors every call: their layout (not their storage) is what
    the plan compares, so the walk is planned, and the spans hold the new tensors."""
    app = _app()
    first = flatten(app)
    torch.rand(3)
    again = flatten(app, plan=first.plan)
    assert again.planned
    _same(again, flatten(app))
    rng_span = next(s for s in again.spans if s.paths == ["rng/torch"])
    assert torch.equal(rng_span.tensors[0], torch.get_rng_state())


def test_plain_values_are_encoded_on_every_walk() -> None:
    app = _app()
    first = flatten(app)
    app["step"] = 4
    app["optim"].param_groups[0]["lr"] = 5e-4
    again = flatten(app, plan=first.plan)
    assert again.planned, "no tensor moved"
    _same(again, flatten(app))
    assert '"v": 4' in json.dumps(again.tree) and "0.0005" in json.dumps(again.tree)


def _swap_data(app: dict[str, Any]) -> None:
    app["model"][0].bias.data = torch.zeros(16)


def _new_parameter(app: dict[str, Any]) -> None:
    app["model"][1].register_parameter("extra", nn.Parameter(torch.ones(3)))


def _freeze(app: dict[str, Any]) -> None:
    app["model"][0].weight.requires_grad_(False)


def _resize(app: dict[str, Any]) -> None:
    app["views"][0].untyped_storage().resize_(64 * 4 + 8)  # same tensors, a bigger storage


def _new_view(app: dict[str, Any]) -> None:
    app["views"][1] = app["views"][0].new_zeros(32)[:].view(4, 8)


def _share_storage(app: dict[str, Any]) -> None:
    app["views"][1] = app["views"][0][:8]  # same layout fields, but now a view onto views[0]'s storage


def _reshape(app: dict[str, Any]) -> None:
    app["views"][1] = app["views"][1].reshape(8, 4)  # same storage and bytes, new shape


def _retype(app: dict[str, Any]) -> None:
    app["views"][0] = app["views"][0].view(torch.int32)  # same storage and bytes, new dtype


def _optimizer_state_appears(app: dict[str, Any]) -> None:
    extra = nn.Parameter(torch.ones(5))
    app["optim"].add_param_group({"params": [extra]})
    extra.grad = torch.ones(5)
    app["optim"].step()


@pytest.mark.parametrize(
    "change",
    [_new_parameter, _freeze, _resize, _new_view, _share_storage, _reshape, _retype, _optimizer_state_appears],
)
def test_any_relayout_takes_the_full_path(change: Any) -> None:
    app = _app()
    first = flatten(app)
    change(app)
    again = flatten(app, plan=first.plan)
    assert not again.planned, change.__name__
    _same(again, flatten(app))
    third = flatten(app, plan=again.plan)  # and the new layout is planned from then on
    assert third.planned
    _same(third, again)


def test_a_storage_swapped_for_one_laid_out_alike_is_planned_from_the_new_storage() -> None:
    app = _app()
    first = flatten(app)
    _swap_data(app)
    again = flatten(app, plan=first.plan)
    assert again.planned
    _same(again, flatten(app))
    bias = app["model"][0].bias
    span = next(s for s in again.spans if any(t is bias for t in s.tensors))
    assert span.storage._cdata == bias.untyped_storage()._cdata


def test_the_plan_holds_no_tensor() -> None:
    import gc
    import weakref

    app = _app()
    plan = flatten(app).plan
    ref = weakref.ref(app["model"][0].weight)
    del app
    gc.collect()
    assert ref() is None, "the plan kept a tensor alive"
    assert plan is not None


def test_checkpointer_reuses_its_plan_and_restores_exactly(tmp_path: Any) -> None:
    app = _app()
    config = gpusnap.Config(chunk_size=512, io_threads=2, fsync=False)
    with gpusnap.Checkpointer(tmp_path / "ck", config=config) as ck:
        first = ck.save(app).wait()
        second = ck.save(app).wait()
        _new_parameter(app)
        third = ck.save(app).wait()
        expected = {k: v.clone() for k, v in app["model"].state_dict().items()}
        with torch.no_grad():
            for p in app["model"].parameters():
                p.zero_()
        ck.restore(app, third.id)
    assert (first.stats["flatten_planned"], second.stats["flatten_planned"], third.stats["flatten_planned"]) == (
        False, True, False)
    for k, v in app["model"].state_dict().items():
        assert torch.equal(v, expected[k]), k
