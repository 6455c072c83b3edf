"""Random number generator state, saved with every checkpoint so dropout and sampling
continue exactly after a resume (plain types and tensors: loads with ``weights_only=True``)."""

from __future__ import annotations

import random
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    import numpy as np

    # Plain types and tensors only, so checkpoints load with torch.load(weights_only=True).
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(tuple(state["python"][:1]) + (tuple(state["python"][1]),) + tuple(state["python"][2:]))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
