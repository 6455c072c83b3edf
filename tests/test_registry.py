"""One registration mechanism for every extension point: each is a ``rolemrc.registry.Registry``;
a toy reward kind and a toy benchmark suite are one registry entry each, used through the public
path (``build_rewards``, ``run_suites``); the converted files keep no if/elif on kind names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from omegaconf import open_dict

from rolemrc.config import OBJECTIVES
from rolemrc.errors import ConfigError
from rolemrc.eval.generation import GENERATION_BACKENDS
from rolemrc.eval.judge import JUDGE_BACKENDS
from rolemrc.eval.suites import SUITES, Suite, run_suites, wants_suites
from rolemrc.models.family import FAMILIES
from rolemrc.registry import Registry, registries
from rolemrc.rewards import REWARD_KINDS, build_rewards
from rolemrc.rollout import ENGINES
from tests.eval.test_evaluate_run import compose_eval

ROOT = Path(__file__).resolve().parents[1]
EXTENSION_POINTS = {"objectives": OBJECTIVES, "reward kinds": REWARD_KINDS, "benchmark suites": SUITES, "generation backends": GENERATION_BACKENDS,
                    "judge backends": JUDGE_BACKENDS, "rollout engines": ENGINES, "model families": FAMILIES}


def test_every_extension_point_is_a_registry() -> None:
    for what, reg in EXTENSION_POINTS.items():
        assert isinstance(reg, Registry), what
        assert reg.names() and registries()[reg.key] is reg, what
        assert all(reg.describe(n) for n in reg.names()), f"{what}: every entry has a one-line doc"


def test_unknown_name_is_one_line_with_the_options_and_the_nearest(monkeypatch) -> None:
    monkeypatch.setattr("rolemrc.registry._ALL", {})  # not listed beside the project's registries
    reg: Registry[int] = Registry("test.kind")
    reg.register("alpha", 1, doc="a")

    @reg.register("beta", doc="b")
    def beta() -> int:
        return 2

    assert reg.get("beta") is beta and list(reg) == ["alpha", "beta"] and reg.get("gamma", None) is None
    with pytest.raises(ConfigError, match=r"^test.kind must be one of alpha, beta, got 'alpah'; did you mean 'alpha'\?$"):
        reg.get("alpah")
    with pytest.raises(ValueError, match="'alpha' is registered already"):
        reg.register("alpha", 3)
    assert list(registries()) == ["test.kind"]


def test_a_toy_reward_kind_is_one_registry_entry() -> None:
    @REWARD_KINDS.register("toy_length", doc="reply length over `scale`")
    def toy_length(*, where: str, cache_dir: object, scale: float = 1.0):
        return lambda *, prompts, completions, **_: [len(c) / scale for c in completions]

    try:
        rewards = build_rewards({"len": {"type": "toy_length", "scale": 2, "weight": 0.5}}, prefix="objective.rewards")
        scores = rewards([[{"role": "user", "content": "hi"}]] * 2, ["abcd", "ab"])
        assert scores.per_reward[:, 0].tolist() == [2.0, 1.0] and scores.rewards.tolist() == [1.0, 0.5]
        with pytest.raises(ValueError, match=r"objective.rewards.len: unknown key\(s\) objective.rewards.len.scal; "
                                             r"known: scale, type, weight"):
            build_rewards({"len": {"type": "toy_length", "scal": 2}}, prefix="objective.rewards")
        with pytest.raises(ValueError, match=r"type must be one of verifier, judge, reward_model, toy_length "
                                             r"\(or give _target_\), got 'toy_lenght'; did you mean 'toy_length'"):
            build_rewards({"len": {"type": "toy_lenght"}})
    finally:
        del REWARD_KINDS["toy_length"]


class _ToySuite:
    """A benchmark that needs no model: its score is its config's ``n``."""

    @staticmethod
    def evaluate(settings, ctx):  # settings: the suite's own group, toy_suite
        return {"score": settings.n}

    @staticmethod
    def render(res):
        return f"## Toy suite\n\nscore {res['score']}\n"

    @staticmethod
    def scalars(res):
        return {"toy/score": float(res["score"])}


def test_a_toy_suite_is_one_registry_entry(tmp_path: Path) -> None:
    replies = tmp_path / "replies.jsonl"
    replies.write_text(json.dumps({"id": "x", "reply": "hi"}) + "\n")
    cfg = compose_eval("generation.backend=file", f"generation.path={replies}", f"out_dir={tmp_path / 'eval'}")
    assert not wants_suites(cfg)
    SUITES.register("toy", Suite("toy_suite", _ToySuite, meta=lambda cfg, resolved: {}), doc="a toy")
    try:
        with open_dict(cfg):
            cfg.toy_suite = {"n": 3}
        assert wants_suites(cfg)
        res = run_suites(cfg)
    finally:
        del SUITES["toy"]
    assert res["results"]["toy"] == {"score": 3} and res["scalars"] == {"toy/score": 3.0}
    assert "score 3" in Path(res["paths"]["summary.md"]).read_text()


# The files whose kinds come from a registry: no branch compares a kind's name there.
CONVERTED = {"src/rolemrc/rewards/combine.py": r"\b(kind|type)\b\s*(==|!=|in\b)\s*[\"'(]",
             "src/rolemrc/eval/suites.py": r"""(get|select)\(\s*["'](rolebench|characterllm|benchmarks)|"""
                                           r"""\bin doc\b|doc\.get\(""",
             "src/rolemrc/eval/judge.py": r"backend\s*(==|!=)\s*[\"']",
             "src/rolemrc/eval/generation.py": r"backend\s*(==|!=)\s*[\"']",
             "src/rolemrc/models/family.py": r"model_type\s*(==|!=|in\b)\s*[\"'(]"}


def test_no_branch_on_kind_names_in_the_converted_files() -> None:
    found = [f"{path}:{i}: {line.strip()}" for path, pattern in CONVERTED.items()
             for i, line in enumerate((ROOT / path).read_text(encoding="utf-8").splitlines(), 1)
             if re.search(pattern, line) and not line.lstrip().startswith("#")]
    assert not found, "branches on kind names (register the kind instead):\n" + "\n".join(found)
