"""Hugging Face causal LMs built from a config, served by a pool process and by
``gpusnap.cold_start`` from a ``gpusnap import`` of their ``save_pretrained`` directory: the
logits are ``from_pretrained``'s on the same weights, bit for bit (CPU, float32), for tied
and untied embeddings, grouped-query attention and scaled rotary embeddings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from restore_support import tiny_config
from test_pool import HANG_S

import gpusnap
from gpusnap.cli.main import main
from gpusnap.pool import Pool

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # (each pool process imports transformers)

IDS = [[3, 17, 42, 8, 91, 5, 60, 2, 33, 70, 11, 24]]  # (longer than original_max_position_embeddings below)

VARIANTS = {
    # tied embeddings, 2 key/value heads for 4 heads, llama3 rotary scaling
    "tied-gqa-llama3": {"tie_word_embeddings": True, "num_key_value_heads": 2,
                        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8}},
    # untied, one key/value head (multi-query), linear rotary scaling
    "untied-mqa-linear": {"tie_word_embeddings": False, "num_key_value_heads": 1,
                          "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
}


def _config(**variant: Any) -> Any:
    return transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=64, bos_token_id=0,
                                    eos_token_id=0, **variant)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits


def test_pool_and_cold_start_give_from_pretrained_logits(tmp_path: Path) -> None:
    made: dict[str, tuple[Path, Any]] = {}
    for i, (name, variant) in enumerate(VARIANTS.items()):
        config = _config(**variant)
        torch.manual_seed(i)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / name / "hf")
        assert main(["import", str(tmp_path / name / "hf"), str(tmp_path / name / "ck")]) == 0
        made[name] = (tmp_path / name, config)
    pools = {name: Pool(where / "ck", "pool_support:serve_hf", config=tiny_config(),
                        env={"POOL_TEST_HF_DIR": str(where / "hf")}) for name, (where, _) in made.items()}
    try:
        for name, (where, config) in made.items():
            reference = transformers.AutoModelForCausalLM.from_pretrained(where / "hf")
            expected = _logits(reference)
            tied = reference.get_output_embeddings().weight is reference.get_input_embeddings().weight
            assert tied == config.tie_word_embeddings

            done = pools[name].take(params={"ids": IDS}, timeout=HANG_S).wait(HANG_S)
            assert done.returncode == 0, done.error
            assert torch.equal(torch.tensor(done.value["logits"]), expected), name
            assert done.value["tied"] == tied and not done.value["training"]

            with gpusnap.Checkpointer(where / "ck", config=tiny_config()) as ck:
                model, handle = gpusnap.cold_start(lambda c=config: transformers.AutoModelForCausalLM.from_config(c),
                                                   ck, device="cpu")
                handle.wait()
            model.eval()
            assert torch.equal(_logits(model), expected), name
    finally:
        for pool in pools.values():
            pool.close()
