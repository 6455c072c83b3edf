"""What rolemrc knows about a model family's layout, in one place.

Sharding (FSDP2 units), probing (activation-capture sites), kernels (Liger's patch), the memory
estimate (the architecture's shape) and the log-prob head all ask here rather than walking a
model themselves. A family transformers already knows needs one entry in :data:`FAMILIES`
(``FAMILIES.register(model_type, Family(...))``, or
none: the defaults fit every decoder-only LM of transformers 5 whose layers sit at
``get_decoder().layers`` with ``self_attn`` and ``mlp`` blocks and a final ``norm``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from rolemrc.registry import Registry


@dataclass(frozen=True)
class Family:
    """One architecture's layout, by transformers ``model_type``."""

    model_type: str
    # Names of the decoder layer's self-attention block (output after o_proj) and feed-forward
    # block (output before the residual add), first match wins; the defaults cover the HF families.
    attention: tuple[str, ...] = ("self_attn", "attention", "attn", "self_attention")
    mlp: tuple[str, ...] = ("mlp", "feed_forward", "ffn", "block_sparse_moe")
    final_norm: str = "norm"  # the decoder's norm after the last layer
    liger_patch: str | None = None  # liger_kernel.transformers function patching RMSNorm/RoPE/SwiGLU


FAMILIES: Registry[Family] = Registry("model_type", doc="model families by transformers model_type; others get the defaults")
for _f in (Family("llama", liger_patch="apply_liger_kernel_to_llama"),
           Family("qwen2", liger_patch="apply_liger_kernel_to_qwen2"),
           Family("qwen3", liger_patch="apply_liger_kernel_to_qwen3"),
           Family("mistral", liger_patch="apply_liger_kernel_to_mistral")):
    FAMILIES.register(_f.model_type, _f, doc=f"liger: {_f.liger_patch}")

# Activation-capture sites of a decoder layer (rolemrc.probing): the submodule whose forward output
# is the activation, by Family attribute; "residual" is the layer's own output.
SITES = ("mlp_out", "attn_out", "residual")
_SITE_FIELD = {"mlp_out": "mlp", "attn_out": "attention"}


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def family_of(model_or_config: Any) -> Family:
    """The :class:`Family` of a model (maybe PEFT-wrapped) or of its transformers config; an
    architecture without an entry gets the defaults under its own ``model_type``."""
    config = getattr(base_model(model_or_config), "config", model_or_config)
    model_type = getattr(config, "model_type", None) or "unknown"
    return FAMILIES.get(model_type, Family(model_type))


def decoder(model: nn.Module) -> nn.Module:
    """The decoder stack (embeddings, layers, final norm), without the output head."""
    base = base_model(model)
    get_decoder = getattr(base, "get_decoder", None)
    if not callable(get_decoder):
        raise ValueError(f"{type(base).__name__} has no get_decoder(): not a transformers decoder-only LM")
    return get_decoder()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder blocks: ``get_decoder().layers`` (every HF decoder-only LM in
    transformers 5); for a model without it, the longest ``nn.ModuleList`` whose entries share
    one class."""
    base = base_model(model)
    if callable(getattr(base, "get_decoder", None)):
        layers = getattr(base.get_decoder(), "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers):
            return layers
    best: nn.ModuleList | None = None
    for module in base.modules():
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            if best is None or len(module) > len(best):
                best = module
    if best is None:
        raise ValueError(f"could not find the decoder layers of {type(base).__name__}: no get_decoder().layers "
                         "and no nn.ModuleList of identical blocks")
    return best


def input_embeddings(model: nn.Module) -> nn.Module:
    return base_model(model).get_input_embeddings()


def output_head(model: nn.Module) -> nn.Module:
    """The output layer (``lm_head``; rolemrc's LogprobHead once installed)."""
    return base_model(model).get_output_embeddings()


def final_norm(model: nn.Module) -> nn.Module:
    dec = decoder(model)
    name = family_of(model).final_norm
    norm = getattr(dec, name, None)
    if not isinstance(norm, nn.Module):
        raise ValueError(f"{type(dec).__name__} has no final norm `{name}`")
    return norm


def attention_implementation(model: nn.Module) -> str:
    """The attention function ``model`` runs: ``sdpa``, ``eager``, ``flash_attention_2`` or a name
    registered with transformers' ``AttentionInterface``.

    transformers sets it with the public ``set_attn_implementation`` but has no public getter;
    this reads the config's ``_attn_implementation``, rolemrc's one read of a transformers
    internal. tests/test_family.py checks it follows ``set_attn_implementation``, so a change in
    transformers fails there."""
    return base_model(model).config._attn_implementation


def set_attention_implementation(model: nn.Module, name: str) -> bool:
    """Switch ``model`` (maybe PEFT-wrapped) to the attention function ``name`` through
    transformers' ``set_attn_implementation``; False when the model cannot switch (its attention
    does not go through ``AttentionInterface``)."""
    base = base_model(model)
    if attention_implementation(base) != name:
        base.set_attn_implementation(name)
    return attention_implementation(base) == name


def tied_embeddings(model: nn.Module) -> bool:
    """True when the output head and the input embeddings share one weight."""
    head, embed = output_head(model), input_embeddings(model)
    return head is not None and getattr(head, "weight", None) is embed.weight


def fsdp_units(model: nn.Module) -> list[nn.Module | list[nn.Module]]:
    """FSDP2 units in the order to shard them: each decoder layer, the embeddings (with the head
    when tied: one parameter must stay one unit), the decoder (its final norm and what is left),
    then the head (untied). rolemrc calls the decoder and the head as modules, so each unit's
    forward hooks gather its parameters."""
    embed, head = input_embeddings(model), output_head(model)
    units: list[nn.Module | list[nn.Module]] = list(decoder_layers(model))
    tied = tied_embeddings(model)
    if tied:
        units.append([embed, head])
    units.append(decoder(model))
    if not tied:
        units.append(head)
    return units


def check_site(site: str) -> str:
    if site not in SITES:
        raise ValueError(f"probing site must be one of {', '.join(SITES)}; got {site!r}")
    return site


def layer_block(layer: nn.Module, names: tuple[str, ...]) -> nn.Module:
    """The first of ``names`` that is a submodule of ``layer``."""
    for name in names:
        block = getattr(layer, name, None)
        if isinstance(block, nn.Module):
            return block
    children = ", ".join(n for n, _ in layer.named_children())
    raise ValueError(f"{type(layer).__name__} has none of {names} (children: {children}); "
                     "name its blocks in rolemrc.models.family.FAMILIES")


def site_module(layer: nn.Module, site: str, family: Family | None = None) -> nn.Module:
    """The submodule of one decoder ``layer`` whose forward output is the ``site`` activation
    (``family``: the model's, :func:`family_of`; default names otherwise)."""
    check_site(site)
    if site == "residual":
        return layer
    return layer_block(layer, getattr(family or Family("unknown"), _SITE_FIELD[site]))


def memory_shape(config: Any) -> dict[str, Any]:
    """The shape numbers the memory estimate needs, from a transformers config (object or dict)."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    hidden = get("hidden_size")
    heads = get("num_attention_heads")
    return {
        "hidden_size": hidden,
        "num_hidden_layers": get("num_hidden_layers"),
        "intermediate_size": get("intermediate_size") or 4 * hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": get("num_key_value_heads") or heads,
        "vocab_size": get("vocab_size"),
        "tie_word_embeddings": bool(get("tie_word_embeddings", False)),
    }
