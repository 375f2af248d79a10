"""RNGState: a restored run draws the same random numbers (torch, random, numpy, CUDA)."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest
import torch

from gpusnap.state import RNGState, SpanInfo, flatten, is_plain, plan_restore
from gpusnap.restore.apply_bytes import apply_all


def draw() -> tuple[Any, ...]:
    cuda = torch.rand(3, device="cuda").tolist() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return (torch.rand(5).tolist(), torch.randint(0, 1 << 30, (3,)).tolist(), random.random(),
            random.gauss(0, 1), np.random.rand(3).tolist(), np.random.standard_normal(), cuda)


def roundtrip_draws() -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    app_state = {"rng": RNGState()}
    flat = flatten(app_state)
    tree = json.loads(json.dumps(flat.tree, allow_nan=False))
    infos = [SpanInfo(s.nbytes, str(s.device)) for s in flat.spans]
    data = {s.index: s.as_bytes().clone() for s in flat.spans}
    first = draw()
    draw()  # move every generator on
    apply_all(plan_restore(app_state, tree, infos), data)
    return first, draw()


def test_state_dict_holds_only_tensors_and_plain_values() -> None:
    state = RNGState().state_dict()
    assert set(state) >= {"torch", "python", "numpy"}
    assert isinstance(state["torch"], torch.Tensor) and isinstance(state["numpy"]["keys"], torch.Tensor)
    assert is_plain(state["python"]) and is_plain({k: v for k, v in state["numpy"].items() if k != "keys"})


def test_roundtrip_torch_python_numpy() -> None:
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    np.random.standard_normal()  # leave a cached gaussian in numpy's state
    random.gauss(0, 1)
    first, again = roundtrip_draws()
    assert first == again


def test_missing_parts_are_skipped() -> None:
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    state = RNGState().state_dict()
    RNGState().load_state_dict({"torch": state["torch"]})
    assert torch.equal(torch.rand(2), expected)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_roundtrip_cuda_generators() -> None:
    torch.cuda.init()
    torch.cuda.manual_seed_all(7)
    assert "cuda" in RNGState().state_dict()
    first, again = roundtrip_draws()
    assert first[-1] is not None and first == again
