"""Forward hooks capture each layer's site output at the last prompt token, on Llama and Qwen2."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rolemrc.probing.capture import (
    SITES,
    capture_activations,
    decoder_layers,
    encode_prompts,
    left_padded,
    site_module,
)
from tests.probing.helpers import items, tiny


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request):
    model, chat = tiny(request.param, layers=3)
    prompts = encode_prompts(chat, items(per_task=1))
    assert len({len(p) for p in prompts}) > 3, "prompts of several lengths, so batches need padding"
    return model, chat, prompts


def test_layers_and_widths_come_from_the_model(setup) -> None:
    model, chat, prompts = setup
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers == 3
    for site in SITES:
        acts = capture_activations(model, prompts[:5], site, chat.tokenizer.pad_token_id, batch_size=5)
        assert acts.shape == (5, 3, model.config.hidden_size) and acts.dtype == torch.float32
        assert torch.isfinite(acts).all()


@pytest.mark.parametrize("site", SITES)
def test_left_padded_batches_equal_one_prompt_at_a_time(setup, site: str) -> None:
    model, chat, prompts = setup
    pad = chat.tokenizer.pad_token_id
    alone = capture_activations(model, prompts, site, pad, batch_size=1)
    batched = capture_activations(model, prompts, site, pad, batch_size=7)
    torch.testing.assert_close(batched, alone, rtol=1e-4, atol=1e-5)


def test_sites_are_the_right_tensors(setup) -> None:
    """residual = hidden_states after the layer; mlp_out + attn_out + input = residual."""
    model, chat, prompts = setup
    pad = chat.tokenizer.pad_token_id
    got = {site: capture_activations(model, prompts[:4], site, pad, batch_size=4) for site in SITES}
    batch = left_padded(prompts[:4], pad)
    with torch.no_grad():
        hidden = model.get_decoder()(**batch, output_hidden_states=True).hidden_states
    n = len(decoder_layers(model))
    for layer in range(n - 1):  # the last entry of hidden_states has the final norm applied
        torch.testing.assert_close(got["residual"][:, layer], hidden[layer + 1][:, -1], rtol=1e-5, atol=1e-6)
    for layer in range(n):  # pre-norm block: out = in + attn_out + mlp_out
        after = hidden[layer][:, -1] + got["attn_out"][:, layer] + got["mlp_out"][:, layer]
        torch.testing.assert_close(after, got["residual"][:, layer], rtol=1e-5, atol=1e-5)


def test_capture_restores_training_mode_and_needs_no_grad(setup) -> None:
    model, chat, prompts = setup
    hooks_before = sum(len(m._forward_hooks) for m in model.modules())  # transformers keeps some of its own
    model.train()
    try:
        acts = capture_activations(model, prompts[:2], "mlp_out", chat.tokenizer.pad_token_id)
        assert model.training and not acts.requires_grad
        assert sum(len(m._forward_hooks) for m in model.modules()) == hooks_before, "capture hooks left behind"
    finally:
        model.eval()


def test_unknown_site_and_missing_submodule_fail_clearly(setup) -> None:
    model, _, prompts = setup
    with pytest.raises(ValueError, match="mlp_out, attn_out, residual"):
        capture_activations(model, prompts[:1], "mlp", 0)
    with pytest.raises(ValueError, match="has none of"):
        site_module(nn.Linear(2, 2), "attn_out")


def test_decoder_layers_fallback_finds_the_block_list() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = nn.Linear(4, 4)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(4, 4), nn.ReLU()])  # mixed types: not blocks
            self.blocks = nn.ModuleList([Block() for _ in range(3)])

    net = Net()
    assert decoder_layers(net) is net.blocks
