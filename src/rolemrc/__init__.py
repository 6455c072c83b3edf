"""rolemrc: SFT, DPO, evaluation and neuron probing for role-playing LLMs (RoleMRC recipe)."""

import os
import sys
from pathlib import Path

__version__ = "0.1.0"


def _offline_unless_asked() -> None:
    """The Hugging Face hub is off unless ``HF_HUB_OFFLINE`` is set (``HF_HUB_OFFLINE=0`` goes
    online): what is local or cached loads at once, and a mistyped hub id or an uncached data set
    ends in one line instead of a minute of retries. Set before huggingface_hub, transformers or
    datasets read it (they read it once, at import); where one was imported before rolemrc, its
    copy of the setting is updated too."""
    if "HF_HUB_OFFLINE" in os.environ:
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    for module, name in (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE")):
        if module in sys.modules:
            setattr(sys.modules[module], name, True)


_offline_unless_asked()

ASSETS = Path(__file__).parent / "assets"


def asset(name: str) -> str:
    """Absolute path of a file or folder shipped in ``rolemrc/assets``."""
    path = ASSETS / name
    if not path.exists():
        raise FileNotFoundError(f"rolemrc asset not found: {path}")
    return str(path)
