"""A released reward model as a local judge: one text in, one number out.

The text is encoded without special tokens, the tokenizer's end-of-sequence token appended, and
an input longer than ``max_length`` keeps its last ``max_length`` tokens (CharacterEval's
``run_char_rm.py``); one forward pass, no attention mask, one example at a time; the number is
the chosen output times ``scale`` plus ``offset``. The model is any
``AutoModelForSequenceClassification`` (its ``logits``) or a class of the model folder's own code
(``model_class: modeling_baichuan.BaichuanCharRM``, an output index as the authors read it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rolemrc.errors import ConfigError, InputNotFound


def _class(reference: str, path: str, key: str) -> Any:
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    module = reference.rsplit(".", 1)[0] if "." in reference else ""
    if not module or not (Path(path) / f"{module}.py").is_file():
        raise ConfigError(f"{key}={reference}: expected '<module>.<Class>' with <module>.py in the model folder {path}")
    try:
        return get_class_from_dynamic_module(reference, path)
    except (AttributeError, ImportError, OSError) as e:
        raise ConfigError(f"{key}={reference}: cannot load it from {path} ({type(e).__name__}: {e})") from None


class RewardJudge:
    """``score(text)``: the reward model's number for one text (see the module docstring)."""

    def __init__(self, model: Any, tokenizer: Any, *, output: Any = "logits", scale: float = 1.0,
                 offset: float = 0.0, max_length: int = 4096, model_id: str = "reward model") -> None:
        if tokenizer.eos_token_id is None:
            raise ConfigError(f"{model_id}: the tokenizer has no end-of-sequence token (appended to every input)")
        self.model, self.tokenizer = model, tokenizer
        self.output, self.scale, self.offset, self.max_length = output, float(scale), float(offset), int(max_length)
        self.model_id = model_id

    @classmethod
    def check(cls, c: Any, where: str) -> None:
        """What can be checked before generation: the folder and the output setting."""
        if not c.path:
            raise ConfigError(f"{where}.path: set it to the reward model's folder")
        if not Path(str(c.path)).expanduser().is_dir():
            raise InputNotFound(f"{where}.path: not a folder: {c.path}")
        if c.output != "logits" and not isinstance(c.output, int):
            raise ConfigError(f"{where}.output must be 'logits' or an output index, got {c.output!r}")
        if c.max_length < 2:
            raise ConfigError(f"{where}.max_length must be >= 2, got {c.max_length}")

    @classmethod
    def load(cls, c: Any, where: str) -> "RewardJudge":
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        cls.check(c, where)
        path = str(Path(str(c.path)).expanduser())
        tok_cls = _class(c.tokenizer_class, path, f"{where}.tokenizer_class") if c.tokenizer_class else AutoTokenizer
        model_cls = (_class(c.model_class, path, f"{where}.model_class") if c.model_class
                     else AutoModelForSequenceClassification)
        tokenizer = tok_cls.from_pretrained(path)
        dtype = c.dtype if c.dtype == "auto" else getattr(torch, c.dtype)
        model = model_cls.from_pretrained(path, dtype=dtype)
        model.to(c.device or ("cuda" if torch.cuda.is_available() else "cpu")).eval()
        return cls(model, tokenizer, output=c.output, scale=c.scale, offset=c.offset, max_length=c.max_length,
                   model_id=path)

    def encode(self, text: str) -> list[int]:
        ids = list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.tokenizer.eos_token_id]
        return ids[-self.max_length:]

    def raw(self, text: str) -> float:
        """The chosen output for ``text``, before ``scale`` and ``offset``."""
        import torch

        ids = torch.tensor([self.encode(text)], device=self.model.device)
        with torch.no_grad():
            out = self.model(input_ids=ids)
        value = out.logits if self.output == "logits" else out[self.output]
        t = torch.as_tensor(value).float().reshape(-1)
        if t.numel() != 1:
            raise ConfigError(f"{self.model_id}: output {self.output!r} holds {t.numel()} numbers, not one score; "
                              "set the reward model's output to the one that holds the score")
        return float(t.item())

    def score(self, text: str) -> float:
        return self.raw(text) * self.scale + self.offset
