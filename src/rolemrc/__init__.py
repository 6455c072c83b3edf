"""rolemrc: SFT, DPO, evaluation and neuron probing for role-playing LLMs (RoleMRC recipe)."""

from pathlib import Path

__version__ = "0.1.0"

ASSETS = Path(__file__).parent / "assets"


def asset(name: str) -> str:
    """Absolute path of a file or folder shipped in ``rolemrc/assets``."""
    path = ASSETS / name
    if not path.exists():
        raise FileNotFoundError(f"rolemrc asset not found: {path}")
    return str(path)
