"""Restraint scales exactly the selected neurons' outputs by the factor, and nothing else."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import torch
from torch import nn

from rolemrc.probing.capture import SITES, decoder_layers, encode_prompts, left_padded, site_module, site_tensor
from rolemrc.probing.restraint import FILENAME, Restraint, load_restraint, restrain
from tests.probing.helpers import items, tiny

FACTOR = 0.5  # large, so the effect is visible (the paper's 1 - 1e-6 is checked in float32 below)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request):
    model, chat = tiny(request.param, layers=3)
    batch = left_padded(encode_prompts(chat, items(per_task=1)[:6]), chat.tokenizer.pad_token_id)
    return model, batch


def site_outputs(model: nn.Module, batch: dict[str, torch.Tensor], site: str) -> list[torch.Tensor]:
    """Every layer's full site output [B, T, H], as the rest of the model sees it."""
    seen: list[Any] = [None] * len(decoder_layers(model))
    handles = []
    for i, layer in enumerate(decoder_layers(model)):
        def hook(module, args, output, i=i):
            seen[i] = site_tensor(output).detach().clone()
        handles.append(site_module(layer, site).register_forward_hook(hook))
    try:
        with torch.no_grad():
            model.get_decoder()(**batch)
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("site", SITES)
def test_only_the_selected_neurons_change_by_the_factor(setup, site: str) -> None:
    model, batch = setup
    layer, neurons = 1, [3, 7, 20]
    before = site_outputs(model, batch, site)
    with restrain(model, [(layer, n) for n in neurons], site, FACTOR):
        during = site_outputs(model, batch, site)
    after = site_outputs(model, batch, site)

    assert torch.equal(during[0], before[0]), "layers before the restrained one are untouched"
    others = [n for n in range(before[layer].shape[-1]) if n not in neurons]
    assert torch.equal(during[layer][..., others], before[layer][..., others]), "other neurons bit-identical"
    torch.testing.assert_close(during[layer][..., neurons], before[layer][..., neurons] * FACTOR, rtol=0, atol=0)
    real = batch["attention_mask"].bool()  # (pad positions may be exactly 0)
    assert before[layer][real][:, neurons].abs().min() > 0  # the check above is not vacuous
    assert not torch.equal(during[2], before[2]), "later layers see the restrained output"
    for b, a in zip(before, after):
        assert torch.equal(a, b), "leaving the context removes the hooks"


def test_restraints_in_several_layers(setup) -> None:
    model, batch = setup
    chosen = {(0, 1), (0, 2), (2, 5)}
    pre: dict[int, torch.Tensor] = {}
    post: dict[int, torch.Tensor] = {}

    def keep(store: dict[int, torch.Tensor], i: int):
        def hook(module, args, output) -> None:  # returns None: observes, never replaces
            store[i] = output.detach().clone()
        return hook

    # Forward hooks run in registration order: one registered before the restraint sees the raw
    # output, one registered after it sees what the rest of the model gets.
    layers = decoder_layers(model)
    handles = [site_module(layer, "mlp_out").register_forward_hook(keep(pre, i)) for i, layer in enumerate(layers)]
    try:
        with restrain(model, sorted(chosen), "mlp_out", FACTOR):
            handles += [site_module(layer, "mlp_out").register_forward_hook(keep(post, i))
                        for i, layer in enumerate(layers)]
            with torch.no_grad():
                model.get_decoder()(**batch)
    finally:
        for h in handles:
            h.remove()
    assert set(pre) == set(post) == {0, 1, 2}
    for i in pre:
        scale = torch.ones(pre[i].shape[-1])
        for layer, neuron in chosen:
            if layer == i:
                scale[neuron] = FACTOR
        assert torch.equal(post[i], pre[i] * scale), f"layer {i}"


def test_json_round_trip_and_loading_from_a_probe_folder(setup, tmp_path) -> None:
    model, batch = setup
    r = Restraint(neurons=[(2, 4), (0, 9)], site="attn_out", factor=FACTOR, selection={"k": 2})
    path = r.save(tmp_path)
    assert path == tmp_path / FILENAME
    data = json.loads(path.read_text())
    assert data["neurons"] == [[2, 4], [0, 9]] and data["site"] == "attn_out" and data["factor"] == FACTOR
    assert Restraint.load(tmp_path) == r == Restraint.load(path)
    before = site_outputs(model, batch, "attn_out")
    with load_restraint(tmp_path, model) as hooks:
        assert hooks.restraint == r
        during = site_outputs(model, batch, "attn_out")
    torch.testing.assert_close(during[0][..., 9], before[0][..., 9] * FACTOR, rtol=0, atol=0)


def test_paper_factor_in_float32_and_warning_in_bfloat16(setup, caplog) -> None:
    model, batch = setup
    before = site_outputs(model, batch, "mlp_out")
    with restrain(model, [(0, 3)], "mlp_out"):  # default factor 1 - 1e-6
        during = site_outputs(model, batch, "mlp_out")
    real = batch["attention_mask"].bool()
    ratio = during[0][real][:, 3] / before[0][real][:, 3]
    torch.testing.assert_close(ratio, torch.full_like(ratio, 1 - 1e-6), rtol=1e-7, atol=1e-7)
    assert (during[0][real][:, 3] != before[0][real][:, 3]).all(), "1 - 1e-6 is not 1.0 in float32"
    layer = nn.Module()
    layer.mlp = nn.Linear(4, 4).to(torch.bfloat16)
    net = nn.Module()
    net.layers = nn.ModuleList([layer])
    with caplog.at_level(logging.WARNING), restrain(net, [(0, 1)], "mlp_out"):
        net.layers[0].mlp(torch.ones(1, 1, 4, dtype=torch.bfloat16))
    assert "no effect" in caplog.text


def test_bad_restraints_fail_clearly(setup, tmp_path) -> None:
    model, batch = setup
    with pytest.raises(ValueError, match="has 3 layers"):
        restrain(model, [(3, 0)])
    with pytest.raises(ValueError, match="has 32 neurons"), restrain(model, [(0, 32)]):
        model.get_decoder()(**batch)
    with pytest.raises(ValueError, match="site must be one of"):
        restrain(model, [(0, 0)], site="mlp")
    with pytest.raises(FileNotFoundError, match="probe.py output folder"):
        load_restraint(tmp_path, model)
    (tmp_path / FILENAME).write_text(json.dumps({"neurons": [[0, 1]]}))
    with pytest.raises(ValueError, match="missing keys"):
        load_restraint(tmp_path, model)
    hooks = restrain(model, [(0, 1)])
    with hooks, pytest.raises(RuntimeError, match="already installed"):
        hooks.__enter__()
