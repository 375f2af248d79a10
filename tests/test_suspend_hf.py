"""A Hugging Face model generating with its KV cache (a ``DynamicCache`` object) suspended and
resumed mid-generation produces the same tokens as a generation never suspended."""

from __future__ import annotations

import inspect

import pytest
import torch

from gpusnap.moving import suspend

transformers = pytest.importorskip("transformers")

# (newer transformers call the cache argument `cache`; older ones `past_key_values`)
_CACHE_ARG = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else "past_key_values"
STEPS = 8
SUSPEND_AT = 3


def _model(device: torch.device):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).to(device).eval()


def _generate(model, prompt: torch.Tensor, pause=None) -> list[int]:  # type: ignore[no-untyped-def]
    """Greedy decoding step by step with a DynamicCache; ``pause(model, cache)`` runs once,
    after SUSPEND_AT tokens."""
    cache = transformers.DynamicCache()
    tokens: list[int] = []
    ids = prompt
    with torch.no_grad():
        for step in range(STEPS):
            if step == SUSPEND_AT and pause is not None:
                pause(model, cache)
            out = model(input_ids=ids, use_cache=True, **{_CACHE_ARG: cache})
            cache = out[_CACHE_ARG] if _CACHE_ARG in out else out.past_key_values
            ids = out.logits[:, -1:].argmax(-1)
            tokens.append(int(ids))
    return tokens


@pytest.mark.parametrize("lazy", [False, True])
def test_generation_resumes_with_its_kv_cache(device: torch.device, lazy: bool) -> None:
    model = _model(device)
    prompt = torch.tensor([[5, 17, 42, 8, 63]], device=device)
    expected = _generate(model, prompt)
    seen = {}

    def pause(model, cache) -> None:  # type: ignore[no-untyped-def]
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        s = suspend({"model": model, "cache": cache}, device=device)
        params = sum(1 for _ in model.parameters())
        seen["tensors"] = s.stats.tensors
        assert s.stats.tensors >= params + 2 * len(cache.layers)  # weights, rotary buffers, cached keys and values
        s.resume(lazy=lazy)
        if lazy:
            assert s.stats.lazy is not None or s.state == "resuming"
        for layer, (k, v) in zip(cache.layers, before):
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
        s.wait()

    assert _generate(model, prompt, pause) == expected
    assert seen["tensors"] > 0
