"""Nested dict/list/tuple in app_state: tensors in place, plain values replaced, tuples rebuilt."""

from __future__ import annotations

import math
import struct
from typing import Any

import torch
from state_support import restore, snapshot

from gpusnap.state import flatten


def test_key_paths_join_keys_with_slashes() -> None:
    app_state = {"outer": {"inner": [torch.zeros(1), {3: torch.ones(1)}]}}
    flat = flatten(app_state)
    assert [s.paths for s in flat.spans] == [["outer/inner/0"], ["outer/inner/1/3"]]


def test_nested_containers_round_trip() -> None:
    t1, t2, t3 = torch.arange(3.0), torch.arange(4), torch.ones(2, 2)
    inner = {"epoch": 7, "best": -0.0, "tags": ["a", "b"], 5: None}
    items = [t2, "label", 1.5]
    app_state: dict[str, Any] = {
        "meta": inner,
        "nested": {"items": items, "pair": (t3, 2**100), "deep": [[t1]]},
        "plain_list": [1, 2, 3],
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "blob": b"\x00\x01",
        "nan": math.nan,
    }
    nested, pair = app_state["nested"], app_state["nested"]["pair"]
    plain_list = app_state["plain_list"]
    snap = snapshot(app_state)

    t1.zero_(); t2.zero_(); t3.zero_()
    inner.update(epoch=99, best=1.0, extra="new")
    del inner[5]
    items[1], items[2] = "changed", -1.0
    plain_list.append(4)
    app_state.update(dtype=torch.float32, size=torch.Size([1]), blob=b"", nan=0.0)

    restore(app_state, snap)

    assert app_state["meta"] is inner and inner == {"epoch": 7, "best": -0.0, "tags": ["a", "b"], 5: None}
    assert struct.pack(">d", inner["best"]) == struct.pack(">d", -0.0)
    assert list(inner) == ["epoch", "best", "tags", 5]
    assert app_state["nested"] is nested and nested["items"] is items
    assert items[0] is t2 and items[1:] == ["label", 1.5]
    assert app_state["plain_list"] is plain_list and plain_list == [1, 2, 3]
    new_pair = nested["pair"]
    assert new_pair == pair and new_pair[0] is t3 and type(new_pair) is tuple
    assert nested["deep"][0][0] is t1
    assert torch.equal(t1, torch.arange(3.0)) and torch.equal(t2, torch.arange(4)) and torch.equal(t3, torch.ones(2, 2))
    assert app_state["dtype"] is torch.bfloat16 and app_state["size"] == torch.Size([2, 3])
    assert app_state["blob"] == b"\x00\x01" and math.isnan(app_state["nan"])


def test_tuples_are_rebuilt() -> None:
    t = torch.arange(2.0)
    app_state: dict[str, Any] = {"pair": (t, "x")}
    snap = snapshot(app_state)
    t.zero_()
    app_state["pair"] = (t, "y")
    restore(app_state, snap)
    assert app_state["pair"] == (t, "x") and app_state["pair"][0] is t
    assert torch.equal(t, torch.arange(2.0))


def test_top_level_tensor_and_scalars() -> None:
    t = torch.randn(4, 4)
    app_state: dict[str, Any] = {"t": t, "step": 10, "name": "run", "flag": True, "none": None}
    snap = snapshot(app_state)
    expected = t.clone()
    t.fill_(0)
    app_state.update(step=11, name="other", flag=False, none=1)
    restore(app_state, snap)
    assert app_state == {"t": t, "step": 10, "name": "run", "flag": True, "none": None}
    assert torch.equal(t, expected)
