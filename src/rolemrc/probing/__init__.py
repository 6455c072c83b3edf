"""Neuron probing (paper §7): last-prompt-token activations per layer, activation-frequency maps
per judged dimension, their discrepancy between two models, and neuron restraint at inference.

For a training callback (in-memory model, a few test items)::

    from rolemrc.probing import balanced_subset, compute_frequency_maps, discrepancy, layer_change
    maps = compute_frequency_maps(pl_module.model, chat, balanced_subset(items, 36), site="mlp_out")
    diff = discrepancy(maps_at_start, maps)          # {group: [L, H]}
"""

from rolemrc.probing.capture import SITES, capture_activations, decoder_layers, iter_activations, site_module
from rolemrc.tasks import balanced_subset
from rolemrc.probing.maps import (
    ALL,
    GROUPS,
    FrequencyCounter,
    FrequencyMaps,
    compute_frequency_maps,
    discrepancy,
    frequency_maps,
    layer_change,
    load_maps,
    ranked_layers,
    save_maps,
    select_neurons,
    top_mask,
)
from rolemrc.probing.restraint import Restraint, RestraintHooks, load_restraint, restrain

__all__ = [
    "ALL", "GROUPS", "SITES", "FrequencyCounter", "FrequencyMaps", "Restraint", "RestraintHooks",
    "balanced_subset", "capture_activations", "compute_frequency_maps", "decoder_layers", "discrepancy",
    "frequency_maps", "iter_activations", "layer_change", "load_maps", "load_restraint", "ranked_layers",
    "restrain", "save_maps", "select_neurons", "site_module", "top_mask",
]
