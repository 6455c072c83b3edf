"""Frequency maps: hand-computed counts, dimension grouping, neuron selection, and a planted
neuron that the discrepancy map finds in the right layer for the right dimension only."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from rolemrc.probing.capture import capture_activations, decoder_layers, encode_prompts
from rolemrc.probing.maps import (
    ALL,
    compute_frequency_maps,
    discrepancy,
    frequency_maps,
    load_maps,
    ranked_layers,
    save_maps,
    select_neurons,
    top_count,
    top_mask,
)
from rolemrc.tasks import NI, TEST_TASKS, balanced_subset, dimensions_of
from tests.probing.helpers import items, tiny

KB_RS = "role_related_mrc_answer_with_narration"  # KB and RS
KB_ONLY = "role_related_mrc_answer_no_narration"
MT_TASK = "role_related_mrc_refused_no_narration-2ndrefused"
NI_TASKS = tuple(t for t in TEST_TASKS if NI in dimensions_of(t))


def test_top_mask_keeps_the_top_fraction_per_layer() -> None:
    acts = torch.tensor([[[5.0, -9.0, 1.0, 3.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0]]])  # [1, 2, 5]
    assert top_count(5, 0.4) == 2 and top_count(4096, 0.2) == 819 and top_count(3, 0.01) == 1
    assert top_mask(acts, 0.4).int().tolist() == [[[1, 0, 0, 1, 0], [0, 0, 0, 1, 1]]]
    assert top_mask(acts, 0.4, rank_by="abs").int().tolist() == [[[1, 1, 0, 0, 0], [0, 0, 0, 1, 1]]]
    with pytest.raises(ValueError, match="top_fraction"):
        top_mask(acts, 0.0)


def test_counts_are_normalised_per_dimension_and_cases_count_for_each_of_their_dimensions() -> None:
    # 3 cases, 1 layer, 4 neurons, top 1 (25%): neuron = argmax.
    acts = torch.tensor([[[9.0, 0, 0, 0]], [[0, 9.0, 0, 0]], [[0, 9.0, 0, 0]]])
    maps = frequency_maps(acts, [KB_RS, KB_ONLY, MT_TASK], "mlp_out", top_fraction=0.25)
    assert maps.n_cases == {"KB": 2, "RS": 1, "MT": 1, "ALL": 3}
    assert maps.freq["KB"].tolist() == [[0.5, 0.5, 0, 0]]
    assert maps.freq["RS"].tolist() == [[1, 0, 0, 0]]
    assert maps.freq["MT"].tolist() == [[0, 1, 0, 0]]
    np.testing.assert_allclose(maps.freq[ALL], [[1 / 3, 2 / 3, 0, 0]])
    assert maps.shape == (1, 4)
    with pytest.raises(KeyError, match="unknown RoleMRC test task"):
        frequency_maps(acts[:1], ["no_such_task"], "mlp_out")


def test_discrepancy_and_layer_ranking() -> None:
    a = frequency_maps(torch.tensor([[[1.0, 0, 0], [1.0, 0, 0]]]), [KB_ONLY], "mlp_out", 1 / 3)
    b = frequency_maps(torch.tensor([[[1.0, 0, 0], [0, 0, 1.0]]]), [KB_ONLY], "mlp_out", 1 / 3)
    diff = discrepancy(a, b)
    assert diff["KB"].tolist() == [[0, 0, 0], [-1, 0, 1]]
    assert ranked_layers(diff["KB"]) == [1, 0]
    c = frequency_maps(torch.zeros(1, 2, 3), [KB_ONLY], "attn_out", 1 / 3)
    with pytest.raises(ValueError, match="different site"):
        discrepancy(a, c)


def test_select_neurons() -> None:
    diff = np.array([[0.1, -0.9, 0.0, 0.2], [0.5, 0.3, -0.4, 0.0], [0.05, 0.0, 0.0, 0.6]])
    assert select_neurons(diff, k=3) == [(0, 1), (2, 3), (1, 0)]
    assert select_neurons(diff, k=2, direction="increase") == [(2, 3), (1, 0)]
    assert select_neurons(diff, k=5, direction="decrease") == [(0, 1), (1, 2)]  # zero changes never picked
    assert select_neurons(diff, k=1, scope="per_layer") == [(0, 1), (2, 3), (1, 0)]
    assert select_neurons(diff, select="fraction", fraction=0.25, scope="per_layer") == [(0, 1), (2, 3), (1, 0)]
    assert select_neurons(diff, select="fraction", fraction=0.2) == [(0, 1), (2, 3), (1, 0)]  # ceil(2.4)
    assert select_neurons(diff, k=2, layers=[1, 2]) == [(2, 3), (1, 0)]
    with pytest.raises(ValueError, match="not a range"):
        select_neurons(diff, layers=[2, 5])


def test_npz_round_trip(tmp_path) -> None:
    a = frequency_maps(torch.randn(4, 2, 5), [KB_RS, KB_ONLY, MT_TASK, KB_ONLY], "residual", 0.4)
    b = frequency_maps(torch.randn(4, 2, 5), [KB_RS, KB_ONLY, MT_TASK, KB_ONLY], "residual", 0.4)
    path = save_maps(tmp_path / "maps.npz", a, b, ("SFT", "DPO"))
    got = load_maps(path)
    assert got["site"] == "residual" and got["names"] == ["SFT", "DPO"] and got["n_cases"]["KB"] == 3
    np.testing.assert_allclose(got["diff"]["ALL"], b.freq["ALL"] - a.freq["ALL"], atol=1e-6)
    assert got["layer_change"]["MT"].shape == (2,)


def test_balanced_subset_covers_every_task() -> None:
    pool = items(per_task=3)
    sub = balanced_subset(pool, 20)
    assert len(sub) == 20 and {i.task for i in sub} == set(TEST_TASKS)
    assert balanced_subset(pool, 1000) == [i for d in range(3) for i in pool[d::3]]


# ---- the planted neuron ----------------------------------------------------------------------

MARKER = "<probe-marker>"
D_STAR = 0    # residual dimension that carries "the marker was in the prompt"
UNIT = 0      # MLP hidden unit of the planted layer that reads it
NEURON = 5    # MLP output neuron it drives
LAYER = 1     # of 4: layers 0 before it, 2 and 3 after it


@torch.no_grad()
def marker_detector(model: torch.nn.Module, marker_id: int) -> None:
    """Make residual dimension D_STAR > 0 at every position after a marker token, exactly 0 otherwise.

    The marker's embedding is e_{D_STAR}, no other token has that dimension; layer 0 attends
    uniformly (q = 0) and copies D_STAR through one value channel into D_STAR; nothing else
    writes D_STAR. Hidden unit UNIT of layer LAYER's MLP reads only D_STAR and writes nothing yet.
    """
    embed = model.get_input_embeddings().weight
    embed[:, D_STAR] = 0
    embed[marker_id] = 0
    embed[marker_id, D_STAR] = 1.0
    layers = decoder_layers(model)
    attn = layers[0].self_attn
    attn.q_proj.weight.zero_()
    if attn.q_proj.bias is not None:  # Qwen2 has q/k/v biases
        attn.q_proj.bias.zero_()
    attn.v_proj.weight[0] = 0
    attn.v_proj.weight[0, D_STAR] = 1.0
    if attn.v_proj.bias is not None:
        attn.v_proj.bias[0] = 0
    for i, layer in enumerate(layers):
        layer.self_attn.o_proj.weight[D_STAR] = 0
        layer.mlp.down_proj.weight[D_STAR] = 0
    attn.o_proj.weight[D_STAR, 0] = 1.0  # head 0, value channel 0
    mlp = layers[LAYER].mlp
    for proj in (mlp.gate_proj, mlp.up_proj):
        proj.weight[UNIT] = 0
        proj.weight[UNIT, D_STAR] = 4.0
    mlp.down_proj.weight[:, UNIT] = 0
    mlp.down_proj.weight[NEURON] = 0  # model A: this output is 0, so rarely among the top 20%


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_planted_neuron_is_found_in_its_layer_for_its_dimension_only(arch: str, capsys) -> None:
    model_a, chat = tiny(arch, layers=4, extra_tokens=[MARKER])
    marker_id = chat.tokenizer.convert_tokens_to_ids(MARKER)
    marker_detector(model_a, marker_id)
    cases = items(per_task=2, marker=MARKER, marked=NI_TASKS)
    pad = chat.tokenizer.pad_token_id

    # Scale the plant so neuron NEURON is clearly the layer's largest on marked prompts.
    model_b = copy.deepcopy(model_a)
    down = decoder_layers(model_b)[LAYER].mlp.down_proj.weight
    marked = [c for c in cases if c.task in NI_TASKS]
    with torch.no_grad():
        down[NEURON, UNIT] = 1.0
        acts_b = capture_activations(model_b, encode_prompts(chat, marked), "mlp_out", pad)[:, LAYER]
        acts_a = capture_activations(model_a, encode_prompts(chat, marked), "mlp_out", pad)[:, LAYER]
        unit = acts_b[:, NEURON]  # = the unit's activation, since A's output there is 0
        assert (unit > 0).all(), "the marker must reach the planted unit"
        down[NEURON, UNIT] = 3 * acts_a.abs().max() / unit.min()

    maps_a = compute_frequency_maps(model_a, chat, cases, "mlp_out", top_fraction=0.2, batch_size=8)
    maps_b = compute_frequency_maps(model_b, chat, cases, "mlp_out", top_fraction=0.2, batch_size=8, progress=True)
    assert f"{len(cases)}/{len(cases)}" in capsys.readouterr().err  # the bar saw every prompt
    diff = discrepancy(maps_a, maps_b)

    assert maps_a.n_cases["NI"] == 8
    for group in ("KB", "RS", "MT", "PI"):  # unmarked prompts: B computes exactly what A does
        assert not diff[group].any(), group
    ni = diff["NI"]
    assert not ni[:LAYER].any(), "nothing changes before the planted layer"
    assert ni[LAYER, NEURON] == pytest.approx(1.0 - maps_a.freq["NI"][LAYER, NEURON])
    assert ni[LAYER, NEURON] >= 0.75
    # k neurons per layer are active, so what the plant gains others lose: each layer sums to 0,
    # and a neuron it pushes out of layer LAYER's top set may drop by as much as it rises.
    np.testing.assert_allclose(ni.sum(axis=1), 0, atol=1e-9)
    others = ni.copy()
    others[LAYER, NEURON] = -np.inf
    assert others.max() < ni[LAYER, NEURON], "the planted neuron has the largest increase"
    assert select_neurons(ni, k=1, direction="increase") == [(LAYER, NEURON)]
    assert select_neurons(diff[ALL], k=1, direction="increase") == [(LAYER, NEURON)]  # NI cases are in ALL
    assert ranked_layers(ni)[0] == LAYER
