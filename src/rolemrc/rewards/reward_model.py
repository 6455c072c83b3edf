"""The ``reward_model`` reward: a local HF sequence-classification model scores each reply.

Each prompt + completion is rendered as one conversation with the reward model's chat template
(its tokenizer's, or the one of ``tokenizer`` when given), tokenized without extra special tokens
and right-padded, and the reward is the model's logit for ``label`` (its only one by default):
what TRL's ``GRPOTrainer`` computes for a ``PreTrainedModel`` reward function. The model is read
offline like ``model.path`` (a local folder; a hub id only from the local cache unless
``HF_HUB_OFFLINE=0``), and never runs code of its own unless ``trust_remote_code`` is set.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rolemrc.errors import ModelSourceError
from rolemrc.models.paths import check_source
from rolemrc.rewards.text import completion_texts


def _torch_dtype(name: str, where: str) -> torch.dtype | str:
    if name == "auto":
        return "auto"
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{where}.dtype: unknown floating-point dtype {name!r} (float32, bfloat16, float16, auto)")
    return dtype


def _loaded(source: str | Path | Any, key: str, what: str, load: Callable[[str], Any]) -> Any:
    """``load`` of a folder or hub id (checked as ``model.path`` is), or ``source`` itself (an object
    already loaded); a load that fails (no weights, not a classifier, custom code refused) is a
    :class:`ModelSourceError` naming ``key`` and ``what`` it should have been."""
    if not isinstance(source, (str, Path)):
        return source
    check_source(str(source), key)
    try:
        return load(str(source))
    except (OSError, ValueError) as err:
        raise ModelSourceError(f"{key}={source}: cannot load {what} ({str(err).splitlines()[0]})") from err


class RewardModelReward:
    """A reward from ``AutoModelForSequenceClassification`` at ``path``: the logit of ``label``
    (an index or an ``id2label`` name; needed only when the model has several labels) for each
    prompt + completion, scored ``batch_size`` at a time on ``device`` (default: CUDA when
    available, else CPU) in ``dtype``. ``model``/``tokenizer`` objects may be given instead of
    paths (tests, or a model already loaded)."""

    def __init__(self, path: str | Path | Any, *, tokenizer: str | Path | Any | None = None, batch_size: int = 8,
                 device: str | None = None, dtype: str = "float32", label: int | str | None = None,
                 trust_remote_code: bool = False, where: str = "reward_model") -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if int(batch_size) < 1:
            raise ValueError(f"{where}.batch_size must be >= 1, got {batch_size}")
        self.batch_size = int(batch_size)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch_dtype = _torch_dtype(dtype, where)
        self.model = _loaded(path, f"{where}.path", "it as a sequence-classification model",
                             lambda p: AutoModelForSequenceClassification.from_pretrained(
                                 p, dtype=torch_dtype, trust_remote_code=trust_remote_code))
        self.name = str(path) if isinstance(path, (str, Path)) else type(path).__name__
        self.tokenizer = _loaded(path if tokenizer is None else tokenizer,
                                 f"{where}.path" if tokenizer is None else f"{where}.tokenizer", "a tokenizer from it",
                                 lambda p: AutoTokenizer.from_pretrained(p, trust_remote_code=trust_remote_code))
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{where}: the tokenizer of {self.name} has no chat template to render the conversations "
                             f"with; give {where}.tokenizer (a tokenizer folder with one)")
        if self.tokenizer.pad_token is None:  # padded positions are masked; the head reads the last real token
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # the classification head finds each row's last token by the pad id: it must be the tokenizer's
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.label = self._label_index(label, where)
        self.model.to(self.device).eval()

    def _label_index(self, label: int | str | None, where: str) -> int:
        n = int(self.model.config.num_labels)
        if label is None:
            if n != 1:
                raise ValueError(f"{where}: {self.name} has {n} labels; set {where}.label "
                                 f"(an index or one of {list(self.model.config.id2label.values())})")
            return 0
        if isinstance(label, str) and not label.lstrip("-").isdigit():
            names = {str(v): int(k) for k, v in self.model.config.id2label.items()}
            if label not in names:
                raise ValueError(f"{where}.label={label!r} is not one of {list(names)}")
            return names[label]
        if not 0 <= int(label) < n:
            raise ValueError(f"{where}.label={label} is out of range: {self.name} has {n} label(s)")
        return int(label)

    def render(self, prompt: Sequence[Mapping[str, Any]], completion: str) -> str:
        """The conversation ending in ``completion``, as the reward model reads it."""
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        return self.tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": completion}],
                                                  tokenize=False)

    @torch.inference_mode()
    def __call__(self, *, prompts: Sequence[Sequence[Mapping[str, Any]]], completions: Sequence[Any],
                 **columns: Any) -> list[float | None]:
        texts = [self.render(p, c) for p, c in zip(prompts, completion_texts(completions), strict=True)]
        out: list[float | None] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                   padding_side="right", add_special_tokens=False).to(self.device)
            logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            out.extend(logits[:, self.label].float().tolist())
        return out

    def close(self) -> None:
        """Frees the model's memory (its device copy) once the run is over."""
        self.model.to("cpu")
