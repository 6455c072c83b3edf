"""rolemrc.models.family: the one place that knows a model family's layout."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rolemrc.models import family
from rolemrc.models.logprob_head import LogprobHead, install_logprob_head

SHAPE = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
             num_key_value_heads=1)


def llama(tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=tied))


def qwen() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True))


def test_families_by_model_type() -> None:
    assert family.family_of(llama()).liger_patch == "apply_liger_kernel_to_llama"
    assert family.family_of(qwen()).liger_patch == "apply_liger_kernel_to_qwen2"
    assert family.family_of(LlamaConfig(**SHAPE)).model_type == "llama"  # a config works as well as a model
    unknown = family.family_of(type("Cfg", (), {"model_type": "newarch"})())
    assert unknown.model_type == "newarch" and unknown.liger_patch is None and unknown.mlp[0] == "mlp"


@pytest.mark.parametrize("tied", [False, True])
def test_fsdp_units_cover_every_parameter_once(tied: bool) -> None:
    model = llama(tied)
    units = family.fsdp_units(model)
    layers = family.decoder_layers(model)
    assert units[:3] == list(layers)
    assert family.tied_embeddings(model) is tied
    if tied:  # embed_tokens and lm_head: one unit, so the shared weight stays one parameter
        assert units[3] == [model.model.embed_tokens, model.lm_head] and units[4] is model.model
    else:
        assert units[3:] == [model.model, model.lm_head]
    # Every parameter is owned by the first unit (in sharding order) that holds it, and by one only.
    seen: set[int] = set()
    for unit in units:
        mods = unit if isinstance(unit, list) else [unit]
        seen |= {id(p) for m in mods for p in m.parameters()}
    assert seen == {id(p) for p in model.parameters()}


def test_layout_through_peft_and_the_logprob_head() -> None:
    model = get_peft_model(qwen(), LoraConfig(r=2, target_modules=["q_proj"]))
    install_logprob_head(model)
    assert isinstance(family.output_head(model), LogprobHead)
    assert family.decoder(model) is model.get_base_model().model
    assert family.final_norm(model) is model.get_base_model().model.norm
    layer = family.decoder_layers(model)[1]
    assert family.site_module(layer, "mlp_out", family.family_of(model)) is layer.mlp
    assert family.site_module(layer, "residual") is layer
    with pytest.raises(ValueError, match="probing site must be one of"):
        family.site_module(layer, "mlp")


def test_memory_shape_reads_config_objects_and_dicts() -> None:
    cfg = Qwen2Config(**SHAPE, tie_word_embeddings=True)
    shape = family.memory_shape(cfg)
    assert shape == family.memory_shape(cfg.to_dict())
    assert shape["num_key_value_heads"] == 1 and shape["tie_word_embeddings"] is True and shape["vocab_size"] == 64


def test_a_family_with_other_block_names_is_one_entry(monkeypatch) -> None:
    """A family whose layers name their blocks differently needs one FAMILIES entry, nothing else."""
    model = llama()
    for layer in family.decoder_layers(model):
        layer.add_module("ff", layer.mlp)
        del layer.mlp
    with pytest.raises(ValueError, match="has none of"):
        family.site_module(family.decoder_layers(model)[0], "mlp_out", family.family_of(model))
    monkeypatch.setitem(family.FAMILIES, "llama", family.Family("llama", mlp=("ff",)))
    layer = family.decoder_layers(model)[0]
    assert family.site_module(layer, "mlp_out", family.family_of(model)) is layer.ff


def test_attention_implementation_follows_transformers_setter() -> None:
    """The one read of a transformers internal (no public getter): it must follow
    ``set_attn_implementation``, through a PEFT wrapper too, and a registered name switches."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = LlamaForCausalLM(LlamaConfig(**SHAPE, attn_implementation="eager"))
    assert family.attention_implementation(model) == "eager"
    model.set_attn_implementation("sdpa")
    assert family.attention_implementation(model) == "sdpa"
    AttentionInterface.register("family_test_sdpa", sdpa_attention_forward)
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert family.set_attention_implementation(wrapped, "family_test_sdpa")
    assert family.attention_implementation(wrapped) == "family_test_sdpa"
    ids = torch.tensor([[1, 2, 3]])
    assert torch.isfinite(wrapped(input_ids=ids).logits).all()  # the registered function runs
