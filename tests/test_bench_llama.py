"""The ``llama`` workload (its shapes, the plain-torch fallback) and the cost suite's writers'
file formats, on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpusnap.bench import workloads
from gpusnap.bench.baselines.pinned_writer import read_raw, write_raw
from gpusnap.bench.llama import LLAMA_SIZES, MiniLlama
from gpusnap.bench.workloads import build_workload


def test_full_llama_shape_is_about_095b_parameters() -> None:
    hidden, layers, heads, kv, mlp, vocab, _b, _s = LLAMA_SIZES["full"]
    with torch.device("meta"):  # no memory, no init time
        model = MiniLlama(hidden=hidden, layers=layers, heads=heads, kv_heads=kv, mlp=mlp, vocab=vocab)
    assert sum(p.numel() for p in model.parameters()) == 953_223_168
    assert (hidden, layers, heads, vocab) == (2048, 16, 16, 32000)


def test_llama_falls_back_to_plain_torch_and_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workloads, "have", lambda module: module != "transformers")
    wl = build_workload("llama", torch.device("cpu"), size="tiny")
    assert "MiniLlama" in wl.impl and wl.kind == "training"
    assert wl.config["optimizer"] == "AdamW" and wl.config["autocast"] == "off (CPU)"  # fused and bf16: CUDA only
    assert set(wl.app_state) == {"model", "optim", "rng", "step"}
    first = wl.step(None)
    assert first is not None and first.dim() == 0 and first.requires_grad is False
    losses = [float(wl.step(None)) for _ in range(3)]
    assert losses[-1] < float(first)  # it learns the fixed batch: the optimizer really steps
    assert any(k.endswith("exp_avg") for k in wl.tensors())  # Adam moments are checkpointed state


def test_raw_file_round_trips_every_dtype_bit_for_bit(tmp_path: Path) -> None:
    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "f32": torch.tensor([float("nan"), -0.0, 1.5]),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
    }
    path = str(tmp_path / "state.bin")
    write_raw(path, tensors)
    got = {k: torch.zeros_like(v) for k, v in tensors.items()}
    read_raw(path, got)
    for name, want in tensors.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
    assert not (tmp_path / "state.bin.tmp").exists()
