"""Every dtype torch can create comes back bit for bit, in place, whatever its layout."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest
import torch

from gpusnap.state import SpanInfo, flatten, plan_restore
from gpusnap.restore.apply_bytes import apply_all

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_QUANTIZED = {getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, n)}


def _creatable(dtype: torch.dtype) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental"
        try:
            return not torch.empty(1, dtype=dtype).is_quantized
        except Exception:
            return False


DTYPES = sorted(
    {d for d in vars(torch).values() if isinstance(d, torch.dtype) and d not in _QUANTIZED and _creatable(d)}, key=str
)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
    ),
]


def int_view(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.element_size() == 16:
        return torch.view_as_real(t).view(torch.int64)
    return t.view(_INT[t.element_size()])


def bits(t: torch.Tensor) -> torch.Tensor:
    return int_view(t).cpu().clone()


def randomize(t: torch.Tensor, seed: int) -> None:
    view = int_view(t)
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (view.numel() * view.element_size(),), dtype=torch.uint8, generator=gen)
    view.copy_(raw.view(view.dtype).reshape(view.shape))


def snapshot_restore(app_state: dict[str, Any], mutate: Any) -> None:
    flat = flatten(app_state)
    tree = json.loads(json.dumps(flat.tree, allow_nan=False))
    infos = [SpanInfo(s.nbytes, str(s.device)) for s in flat.spans]
    data = {s.index: s.as_bytes().clone() for s in flat.spans}
    mutate()
    apply_all(plan_restore(app_state, tree, infos), data)


def test_all_float8_and_special_dtypes_are_covered() -> None:
    names = {str(d) for d in DTYPES}
    for name in ("float8_e4m3fn", "float8_e5m2", "bool", "complex128", "complex32", "uint64", "bfloat16"):
        assert f"torch.{name}" in names


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtype_roundtrip_bitwise_in_place(dtype: torch.dtype, device: str) -> None:
    try:
        base = torch.empty(6, 5, dtype=dtype, device=device)
    except Exception as exc:  # pragma: no cover - a device without this dtype
        pytest.skip(f"{dtype} not creatable on {device}: {exc}")
    app_state = {
        "matrix": torch.empty(3, 5, dtype=dtype, device=device),
        "scalar": torch.empty((), dtype=dtype, device=device),
        "empty": torch.empty(0, 4, dtype=dtype, device=device),
        "strided": base[::2].t(),  # non-contiguous view with gaps
    }
    for seed, t in enumerate((app_state["matrix"], app_state["scalar"], base)):
        randomize(t, seed)
    before = {k: bits(v) for k, v in app_state.items()}
    pointers = {k: v.data_ptr() for k, v in app_state.items()}

    def mutate() -> None:
        for seed, t in enumerate((app_state["matrix"], app_state["scalar"], base)):
            randomize(t, 100 + seed)

    snapshot_restore(app_state, mutate)
    for key, value in app_state.items():
        assert value.dtype == dtype and value.data_ptr() == pointers[key]
        assert torch.equal(bits(value), before[key]), key


@pytest.mark.parametrize("device", DEVICES)
def test_nan_payloads_survive(device: str) -> None:
    patterns = {
        torch.float32: (torch.int32, [0x7FC00001, -0x00400001, 0x7F800001, 0x7FFFFFFF]),
        torch.float64: (torch.int64, [0x7FF0000000000001, -0x0008000000000001, 0x7FF8DEADBEEF0001]),
        torch.float16: (torch.int16, [0x7C01, -0x0201, 0x7FFF]),
        torch.bfloat16: (torch.int16, [0x7F81, -0x007F, 0x7FC1]),
    }
    app_state: dict[str, Any] = {}
    for dtype, (int_dtype, values) in patterns.items():
        app_state[str(dtype)] = torch.tensor(values, dtype=int_dtype, device=device).view(dtype)
    c = torch.zeros(2, dtype=torch.complex128, device=device)
    torch.view_as_real(c).view(torch.int64).copy_(torch.tensor([[0x7FF0000000000001, 1], [-1, 0x7FF8000000000123]]))
    app_state["complex"] = c
    before = {k: bits(v) for k, v in app_state.items()}
    assert all(torch.isnan(v).any() for v in app_state.values())
    snapshot_restore(app_state, lambda: [v.zero_() for v in app_state.values()])
    for key, value in app_state.items():
        assert torch.equal(bits(value), before[key]), key
