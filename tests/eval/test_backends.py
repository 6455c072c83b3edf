"""Evaluation backends are objects from one registry each (generation, judge), and every answer
cache keys its requests with one hash."""

from __future__ import annotations

import hashlib
import re
from types import SimpleNamespace

import pytest

from rolemrc.api import request_key
from rolemrc.config import JudgeConfig
from rolemrc.errors import ConfigError
from rolemrc.eval.generation import GENERATION_BACKENDS, generation_backend, model_label
from rolemrc.eval.judge import JUDGE_BACKENDS, HFBackend, OpenAIBackend, cache_key, judge_backend, uses_evaluated_model
from tests.conftest import ROOT


def _cfg(backend: str, **gen: object) -> SimpleNamespace:
    return SimpleNamespace(generation=SimpleNamespace(backend=backend, **gen),
                           model=SimpleNamespace(path=None, name="tiny"), seed=3, restraint=None,
                           judge=JudgeConfig(backend="none"))


def test_generation_backends_come_from_the_registry() -> None:
    assert list(GENERATION_BACKENDS) == ["hf", "vllm", "openai", "file"]
    for name, b in GENERATION_BACKENDS.items():
        assert generation_backend(_cfg(name)) is b and b.name == name
    assert [n for n, b in GENERATION_BACKENDS.items() if b.local] == ["hf", "vllm"]
    assert [n for n, b in GENERATION_BACKENDS.items() if b.loads_model] == ["hf"]
    assert [n for n, b in GENERATION_BACKENDS.items() if not b.generates] == ["file"]
    with pytest.raises(ConfigError, match=r"generation.backend must be one of hf, vllm, openai, file, got 'vlm'"):
        generation_backend(_cfg("vlm"))
    assert model_label(_cfg("hf")) == "random-init tiny (seed 3)"
    assert model_label(_cfg("openai", model="m", base_url="http://x")) == "m (OpenAI-compatible API at http://x)"


def test_a_backend_without_a_local_model_refuses_what_needs_one() -> None:
    cfg = _cfg("file", path="r.jsonl", on_missing="error")
    cfg.judge = JudgeConfig(backend="hf", model=None)
    with pytest.raises(ConfigError, match="generation.backend=file does not load: set judge.model"):
        generation_backend(cfg).check(cfg, cfg.judge)
    cfg.restraint = "spec"
    with pytest.raises(ConfigError, match="restraint hooks into a transformers model: not with generation.backend=file"):
        generation_backend(cfg).check(cfg, cfg.judge)


def test_judge_backends_come_from_the_registry() -> None:
    assert dict(JUDGE_BACKENDS.items()) == {"none": None, "hf": HFBackend, "openai": OpenAIBackend}
    assert judge_backend(JudgeConfig(backend="none")) is None
    assert uses_evaluated_model(JudgeConfig(backend="hf", model=None))
    assert not uses_evaluated_model(JudgeConfig(backend="hf", model="some/judge"))
    assert not uses_evaluated_model(JudgeConfig(backend="openai", model=None))
    assert OpenAIBackend.asks_again and not HFBackend.asks_again
    with pytest.raises(ValueError, match="judge.backend must be one of none, hf, openai"):
        judge_backend(JudgeConfig(backend="gpt"))


def test_one_request_hash() -> None:
    messages = [{"role": "user", "content": "Grüß dich"}]
    assert cache_key("m", messages, {"temperature": 0.7}) == request_key(
        {"sampling": {"temperature": 0.7}, "messages": messages, "model": "m"})  # key order does not matter
    assert request_key({"a": 1}) != request_key({"a": 2})
    # sha256 of the compact JSON (the form synthesis caches were written with)
    assert request_key({"b": [1, "é"], "a": None}) == hashlib.sha256('{"a":null,"b":[1,"é"]}'.encode()).hexdigest()


def test_no_backend_name_is_compared_outside_the_registries() -> None:
    pattern = re.compile(r"backend\s*(==|!=|\bin\b|\bnot in\b)\s*[(\"']")
    hits = [f"{p.relative_to(ROOT)}:{n}" for d in ("eval", "callbacks") for p in (ROOT / "src/rolemrc" / d).rglob("*.py")
            for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits
