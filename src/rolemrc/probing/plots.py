"""PNG figures of frequency and discrepancy maps.

Drawn on bare ``matplotlib.figure.Figure`` objects, which render with the Agg canvas: no display
needed, and pyplot's global backend (e.g. a notebook's) is left alone.

Neuron order: columns are neurons in **index order** (0 .. H-1), rows are layers (0 at the top),
as in the paper's layers x neurons heatmaps. Why index order and not, say, sorted by frequency:
for all three sites the "neurons" are hidden-size dimensions that every layer reads from and
writes to the same residual stream, so column j is the same channel in every layer, in every
dimension's panel and in both models; any sort would give each panel its own column meaning and
make panels incomparable. Wide maps (e.g. 4096 neurons) are shown in at most ``max_columns``
columns, each the entry of largest magnitude among its neurons (sign kept), so a single strongly
changed neuron never disappears into an average.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from rolemrc.tasks import Dimension

_TITLES = {d.short: f"{d.short}: {d.title}" for d in Dimension} | {"ALL": "ALL: every test case"}


def _save(fig: Figure, path: str | Path) -> Path:
    """``fig`` written to ``path`` (PNG, its folder made); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def pool_columns(values: np.ndarray, max_columns: int) -> tuple[np.ndarray, int]:
    """[L, H] -> ([L, ceil(H / s)], s): groups of ``s`` adjacent neurons shown as one column,
    holding the group's entry of largest magnitude (sign kept)."""
    n_layers, width = values.shape
    step = max(1, -(-width // max_columns))
    if step == 1:
        return values, 1
    pad = (-width) % step
    padded = np.pad(values, ((0, 0), (0, pad)))  # zeros never win a max-magnitude contest
    blocks = padded.reshape(n_layers, -1, step)
    pick = np.abs(blocks).argmax(axis=-1)[..., None]
    return np.take_along_axis(blocks, pick, axis=-1)[..., 0], step


def plot_maps(
    maps: Mapping[str, np.ndarray],
    path: str | Path,
    title: str,
    diverging: bool = False,
    max_columns: int = 1024,
) -> Path:
    """One heatmap panel per group (layers x neurons) into one PNG.

    ``diverging``: a discrepancy map (red = more often active in B, blue = less), colour scale
    symmetric around 0; otherwise frequencies on [0, 1].
    """
    groups = list(maps)
    if not groups:
        raise ValueError("no maps to plot")
    n_layers, width = maps[groups[0]].shape
    fig = Figure(figsize=(12, 1.2 + (0.5 + 0.06 * max(n_layers, 8)) * len(groups)), layout="constrained")
    axes = fig.subplots(len(groups), 1, squeeze=False, sharex=True)
    extend = "neither"
    if diverging:
        # Colour scale from the 99.5th percentile of |change|: a few extreme neurons saturate
        # (still the darkest cells) instead of washing out everything else.
        magnitudes = np.abs(np.concatenate([np.ravel(m) for m in maps.values()]))
        vmax = float(np.quantile(magnitudes, 0.995)) or float(magnitudes.max()) or 1.0
        vmin, cmap = -vmax, "RdBu_r"
        extend = "both" if magnitudes.max() > vmax else "neither"
    else:
        vmin, vmax, cmap = 0.0, 1.0, "viridis"
    image = None
    for ax, group in zip(axes[:, 0], groups):
        shown, step = pool_columns(np.asarray(maps[group], dtype=np.float64), max_columns)
        image = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap=cmap, vmin=vmin, vmax=vmax,
                          extent=(0, width, n_layers - 0.5, -0.5))
        ax.set_title(_TITLES.get(group, group), fontsize=9, loc="left")
        ax.set_ylabel("layer")
    axes[-1, 0].set_xlabel("neuron (index order" + (f"; {step} per column, largest |value| shown)" if step > 1 else ")"))
    fig.suptitle(title)
    fig.colorbar(image, ax=axes[:, 0].tolist(), fraction=0.02, pad=0.01, extend=extend,
                 label="freq B - freq A" if diverging else "share of test cases in the top set")
    return _save(fig, path)


def plot_layer_change(changes: Mapping[str, np.ndarray], path: str | Path, title: str) -> Path:
    """Grouped bars: per layer, the mean |discrepancy| of each group ([L] each)."""
    groups = list(changes)
    if not groups:
        raise ValueError("no layer changes to plot")
    n_layers = len(changes[groups[0]])
    x = np.arange(n_layers)
    bar = 0.8 / len(groups)
    fig = Figure(figsize=(min(16.0, max(6.0, 0.06 * n_layers * len(groups) + 3)), 4.5), layout="constrained")
    ax = fig.subplots()
    for i, group in enumerate(groups):
        ax.bar(x + (i - (len(groups) - 1) / 2) * bar, changes[group], width=bar, label=group)
    ax.set_xticks(x)
    ax.set_xlabel("layer")
    ax.set_ylabel("mean |freq B - freq A| over neurons")
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=len(groups), loc="upper center", bbox_to_anchor=(0.5, -0.15), frameon=False)
    return _save(fig, path)
