"""flatten refuses what it cannot store, naming the key path and what is unsupported."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from gpusnap.errors import CheckpointError
from gpusnap.state import flatten


class _MyTensor(torch.Tensor):
    pass


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized creation is deprecated
        return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (_quantized, "quantized"),
        (lambda: torch.eye(3).to_sparse(), "layout"),
        (lambda: torch.eye(3).to_sparse_csr(), "layout"),
        (lambda: torch.empty(3, device="meta"), "meta"),
        (lambda: torch.ones(2).as_subclass(_MyTensor), "subclass"),
        (lambda: torch.ones(2, dtype=torch.complex64).conj(), "conj"),
        (lambda: object(), "Stateful"),
        (lambda: lambda x: x, "allow_pickle=True"),
    ],
)
def test_unsupported_value_is_named(make: Any, needle: str) -> None:
    app_state = {"outer": {"inner": [1, make()]}}
    with pytest.raises(CheckpointError) as err:
        flatten(app_state)
    assert "outer/inner/1" in str(err.value) and needle in str(err.value)


def test_mkldnn_layout_is_refused() -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no mkldnn")
    with pytest.raises(CheckpointError, match="w.*layout"):
        flatten({"w": torch.ones(2, 2).to_mkldnn()})


def test_lazy_module_parameter_is_refused() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lazy modules warn that they are experimental
        model = nn.Sequential(nn.LazyLinear(3))
    with pytest.raises(CheckpointError, match="model/0.weight.*lazy"):
        flatten({"model": model})


def test_tensor_dict_key_is_refused() -> None:
    with pytest.raises(CheckpointError, match="keys must be plain"):
        flatten({"d": {torch.zeros(1): 1}})


def test_self_referencing_container_is_refused() -> None:
    loop: list[Any] = [torch.zeros(1)]
    loop.append(loop)
    with pytest.raises(CheckpointError, match="loop.*cycle"):
        flatten({"loop": loop})


def test_failing_state_dict_is_named() -> None:
    class Broken:
        def state_dict(self) -> dict[str, Any]:
            raise ValueError("boom")

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    with pytest.raises(CheckpointError, match="thing.*boom"):
        flatten({"thing": Broken()})

