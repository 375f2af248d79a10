"""cold_start from the two most natural inputs: a training checkpoint (the model beside its
optimizer, step and RNG state) and a ``gpusnap import`` of a ``save_pretrained`` directory
(which leaves tied embeddings out). The model's entry is found, only its chunks are read, and
tied weights come back tied, with ``from_pretrained``'s logits bit for bit (CPU, float32)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from restore_support import held_root, tiny_config
from test_restore_cold import TinyLM
from torch import nn

import gpusnap
from gpusnap.cli.main import main
from gpusnap.restore.template_free import UnknownKeyError


def TiedLM(layers: int = 2) -> TinyLM:  # noqa: N802  (a model class, as the tests read)
    """Tied input and output embeddings and a non-persistent causal mask, as in GPT-2 (small)."""
    return TinyLM(vocab=48, dim=16, layers=layers, ctx=8)


def _training_state(device: torch.device | str = "cpu", layers: int = 2) -> dict[str, Any]:
    """A model trained three AdamW steps, with the optimizer, step and RNG state beside it."""
    torch.manual_seed(0)
    model = TiedLM(layers).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        ids = torch.randint(0, 48, (4, 8), device=device)
        model(ids).logsumexp(-1).mean().backward()
        optim.step()
        optim.zero_grad()
    return {"model": model, "optim": optim, "step": 3, "rng": gpusnap.RNGState()}


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


def _unique_bytes(model: nn.Module) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()}
    return sum(storages.values())


def test_cold_start_of_a_training_checkpoint_gives_the_trained_models_logits(tmp_path: Path, device: torch.device):
    state = _training_state(device)
    trained = state["model"]
    ids = torch.randint(0, 48, (2, 8), device=device)
    with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        ck.save(state, blocking=True)
    with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        torch.manual_seed(1)  # (nothing may come from an initialisation)
        model, handle = gpusnap.cold_start(TiedLM, ck, device=device)
        out = _logits(model, ids)
        handle.wait()
    assert torch.equal(out, _logits(trained, ids))
    assert model.head.weight is model.emb.weight, "tied as built"
    assert sorted(handle.stats["unexpected"]) == ["optim", "rng", "step"] and handle.stats["missing"] == []
    assert handle.stats["bytes_read"] == _unique_bytes(trained), "the optimizer's moments were not read"


def test_cold_start_restores_the_other_keys_app_state_names(tmp_path: Path):
    with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        ck.save(_training_state(), blocking=True)
        asked: dict[str, Any] = {"step": -1}
        model, handle = gpusnap.cold_start(TiedLM, ck, device="cpu", app_state=asked)
        handle.wait()
        assert asked == {"step": 3, "model": model}
        with pytest.raises(gpusnap.RestoreMismatchError, match=r"app_state keys \['epoch'\] are not in checkpoint"):
            gpusnap.cold_start(TiedLM, ck, device="cpu", app_state={"epoch": 0})


def test_a_model_that_does_not_fit_is_refused_naming_only_its_own_keys(tmp_path: Path, monkeypatch):
    with held_root(tmp_path / "ck", monkeypatch) as backend, \
            gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        ck.save(_training_state(), blocking=True)
        with pytest.raises(gpusnap.RestoreMismatchError) as raised:
            gpusnap.cold_start(lambda: TiedLM(layers=3), ck, device="cpu")
        with pytest.raises(UnknownKeyError, match=r"key 'net' names nothing .* top-level keys are \['model', 'optim'"):
            gpusnap.cold_start(TiedLM, ck, device="cpu", key="net")
    assert "blocks.2.weight" in str(raised.value) and "optim" not in str(raised.value)
    assert not backend.chunk_reads, "refused before any chunk was read"


def test_the_models_entry_is_found_by_its_keys_or_named(tmp_path: Path):
    torch.manual_seed(0)
    net, student, teacher = TiedLM(), TiedLM(), TiedLM()
    ids = torch.randint(0, 48, (2, 8))
    with gpusnap.Checkpointer(tmp_path / "one", config=tiny_config()) as ck:
        ck.save({"step": 5, "net": net}, blocking=True)
        model, handle = gpusnap.cold_start(TiedLM, ck, device="cpu")
        handle.wait()
        assert torch.equal(_logits(model, ids), _logits(net, ids))
    with gpusnap.Checkpointer(tmp_path / "two", config=tiny_config()) as ck:
        ck.save({"student": student, "teacher": teacher}, blocking=True)
        with pytest.raises(gpusnap.RestoreMismatchError, match=r"several entries .*'student', .*'teacher'.*key="):
            gpusnap.cold_start(TiedLM, ck, device="cpu")
        model, handle = gpusnap.cold_start(TiedLM, ck, device="cpu", key="teacher")
        handle.wait()
    assert torch.equal(_logits(model, ids), _logits(teacher, ids))
    assert handle.stats["unexpected"] == ["student"]


# -- save_pretrained, imported -----------------------------------------------------------------

def _hf_config(name: str, *, tied: bool | None = None) -> Any:
    transformers = pytest.importorskip("transformers")
    tie = name != "llama-untied" if tied is None else tied
    if name == "gpt2":
        return transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                       tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaConfig(  # grouped-query attention: fewer key/value heads than heads
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0)


def _builder(config: Any) -> Callable[[], nn.Module]:
    from transformers import AutoModelForCausalLM

    return lambda: AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(("name", "how"), [(name, how) for name in ("gpt2", "llama-tied") for how in
                                           ("api --key model", "cli, no key")] + [("llama-untied", "cli, no key")])
def test_cold_start_of_an_imported_save_pretrained_model_matches_from_pretrained(tmp_path: Path, name: str, how: str):
    from transformers import AutoModelForCausalLM

    config = _hf_config(name)
    torch.manual_seed(0)
    _builder(config)().save_pretrained(tmp_path / "hf")
    root = tmp_path / "ck"
    if how.startswith("api"):
        gpusnap.import_(tmp_path / "hf", root, key="model", config=tiny_config())
    else:
        assert main(["import", str(tmp_path / "hf"), str(root)]) == 0
    with gpusnap.Checkpointer(root, config=tiny_config()) as ck:
        torch.manual_seed(1)
        model, handle = gpusnap.cold_start(_builder(config), ck, device="cpu")
        handle.wait()
        tied = bool(config.tie_word_embeddings)
        opposite = _hf_config(name, tied=not tied)  # a build that ties otherwise cannot be served from it
        with pytest.raises(gpusnap.RestoreMismatchError, match="lm_head.weight"):
            gpusnap.cold_start(_builder(opposite), ck, device="cpu")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    model.eval()  # (as from_pretrained returns it: no dropout)
    ids = torch.randint(0, 96, (2, 12))
    assert torch.equal(_logits(model, ids).logits, _logits(reference, ids).logits)
    embeddings, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert (head is embeddings) == tied == (reference.get_output_embeddings().weight is
                                            reference.get_input_embeddings().weight)
    if tied:
        assert head.untyped_storage().data_ptr() == embeddings.untyped_storage().data_ptr()
        prefix = "model." if how.startswith("api") else ""
        assert handle.stats["missing"] == [f"{prefix}lm_head.weight"]
    assert handle.stats["unexpected"] == []


def test_a_bare_state_dict_has_no_other_keys_for_app_state(tmp_path: Path):
    config = _hf_config("llama-tied")
    _builder(config)().save_pretrained(tmp_path / "hf")
    gpusnap.import_(tmp_path / "hf", tmp_path / "ck", config=tiny_config())
    with gpusnap.Checkpointer(tmp_path / "ck", config=tiny_config()) as ck:
        with pytest.raises(gpusnap.RestoreMismatchError, match="state_dict alone: it has no keys \\['step'\\]"):
            gpusnap.cold_start(_builder(config), ck, device="cpu", app_state={"step": 0})
