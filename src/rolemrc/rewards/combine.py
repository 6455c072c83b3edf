"""Weighted rewards, their per-reward values and metrics, built from a plain config mapping."""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from rolemrc.errors import UserError
from rolemrc.objectives.grpo import nanstd
from rolemrc.registry import Registry
from rolemrc.rewards.judge import JudgeReward
from rolemrc.rewards.reward_model import RewardModelReward
from rolemrc.rewards.verifier import VerifierReward


class RewardFn(Protocol):
    """TRL's reward-function signature: keyword-only ``prompts`` (conversations up to the assistant's
    turn), ``completions`` (strings) and the prompt records' other fields as lists; one float or
    ``None`` (not applicable) per completion."""

    def __call__(self, *, prompts: Sequence[Any], completions: Sequence[str],
                 **columns: Sequence[Any]) -> Sequence[float | None]: ...


class RewardValueError(UserError, ValueError):
    """A reward returned something that is not one finite number or ``None`` per completion."""


def _shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def checked_values(name: str, got: Any, n: int, fn: Any = None) -> list[float | None]:
    """The values reward ``name`` returned for ``n`` completions, checked: a list (tuple, array, tensor)
    of ``n`` numbers or ``None``; a NaN is "does not apply" as ``None`` is; an infinite value, a
    non-number, another count or no list at all is a :class:`RewardValueError` naming the reward
    (and its callable) and what it returned."""
    what = f"reward {name!r}" + (f" ({_callable_name(fn)})" if _callable_name(fn) else "")
    expected = f"expected a list of {n} values, one float or None per completion"
    if hasattr(got, "tolist") and not isinstance(got, (str, bytes)):  # a tensor or an array
        got = got.tolist()
    if isinstance(got, (str, bytes, dict)) or not isinstance(got, Sequence):
        raise RewardValueError(f"{what} returned {_shown(got)} ({type(got).__name__}); {expected}")
    if len(got) != n:
        raise RewardValueError(f"{what} returned {len(got)} values for {n} completions; {expected}")
    values: list[float | None] = []
    for i, v in enumerate(got):
        if v is None:
            values.append(None)
            continue
        if not isinstance(v, numbers.Real):  # bool is one (1.0 / 0.0), as TRL reads it
            raise RewardValueError(f"{what} returned {_shown(v)} ({type(v).__name__}) for completion {i} of {n}; "
                                   "expected a float, or None where the reward does not apply")
        f = float(v)
        if math.isinf(f):
            raise RewardValueError(f"{what} returned {f} for completion {i} of {n}: a reward must be finite "
                                   "(None or NaN: does not apply to that completion)")
        values.append(None if math.isnan(f) else f)
    return values


def _callable_name(fn: Any) -> str:
    """``module.qualname`` of a reward callable (through ``functools.partial``), or '' for a built-in
    reward class of rolemrc's (the reward's name says enough)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if fn is None or type(fn).__module__.startswith("rolemrc."):
        return ""
    target = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(fn).__name__)}"


@dataclass
class RewardScores:
    """``per_reward`` ``[N, K]`` (NaN: not applicable / not obtained); ``rewards`` ``[N]``: the
    weighted sum over the rewards that apply (NaN where none does: unscorable, advantage 0);
    ``metrics``: ``rewards/<name>/mean`` and ``/std`` (over the completions it applies to),
    ``rewards/<name>/missing`` for a judge (judgements without a verdict, ``on_failure: skip``),
    ``reward``, ``reward_std``, and ``rewards/disagreement/<judge>_vs_<verifier>`` where both scored
    some completion (NaN when none, so a logger shows a gap, not a rate of 0)."""

    names: list[str]
    per_reward: Tensor
    rewards: Tensor
    metrics: dict[str, float]


def disagreement_rate(judge: Sequence[float | None], verifier: Sequence[float | None]) -> tuple[float | None, int]:
    """(rate, n) over completions both scored: judge says met (>= 0.5) but the rules are not all met
    (verifier < 1), or the reverse. A judge that agrees less and less with the program checks while
    its reward rises is being gamed. ``None`` when no completion has both."""
    pairs = [(j, v) for j, v in zip(judge, verifier, strict=True)
             if j is not None and v is not None and not math.isnan(j) and not math.isnan(v)]
    if not pairs:
        return None, 0
    return sum((j >= 0.5) != (v >= 1.0) for j, v in pairs) / len(pairs), len(pairs)


def mean_metrics(names: Sequence[str], per: Tensor, rewards: Tensor) -> dict[str, float]:
    """``rewards/<name>/mean`` and ``/std`` of each reward's column of ``per`` (over the completions
    it applies to), and ``reward``, ``reward_std`` of the weighted sums ``rewards``."""
    metrics: dict[str, float] = {}
    for k, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(per[:, k]).item()
        metrics[f"rewards/{name}/std"] = nanstd(per[:, k]).item()
    return {**metrics, "reward": torch.nanmean(rewards).item(), "reward_std": nanstd(rewards).item()}


class RewardSet:
    """Named rewards with weights (TRL's ``reward_funcs`` / ``reward_weights``, summed then normalised)."""

    def __init__(self, rewards: Mapping[str, Callable[..., Sequence[float | None]]],
                 weights: Mapping[str, float] | None = None) -> None:
        if not rewards:
            raise ValueError("no rewards given")
        self.rewards = dict(rewards)
        weights = dict(weights or {})
        unknown = sorted(set(weights) - set(self.rewards))
        if unknown:
            raise ValueError(f"weights for unknown reward(s) {', '.join(unknown)}; rewards: {', '.join(self.rewards)}")
        self.weights = {name: float(weights.get(name, 1.0)) for name in self.rewards}

    def __call__(self, prompts: Sequence[Any], completions: Sequence[str],
                 columns: Mapping[str, Sequence[Any]] | None = None) -> RewardScores:
        columns = dict(columns or {})
        n = len(completions)
        names = list(self.rewards)
        per = torch.full((n, len(names)), float("nan"), dtype=torch.float64)
        values: dict[str, list[float | None]] = {}
        for k, name in enumerate(names):
            fn = self.rewards[name]
            got = checked_values(name, fn(prompts=list(prompts), completions=list(completions), **columns), n, fn)
            values[name] = got
            per[:, k] = torch.tensor([float("nan") if v is None else v for v in got], dtype=torch.float64)
        rewards = self.combine(per, names)
        metrics = mean_metrics(names, per, rewards)
        for name in names:
            if isinstance(self.rewards[name], JudgeReward):  # skipped judgements: reported, not scored
                metrics[f"rewards/{name}/missing"] = float(sum(self.rewards[name].last_missing.values()))
        for jn in (nm for nm in names if isinstance(self.rewards[nm], JudgeReward)):
            for vn in (nm for nm in names if isinstance(self.rewards[nm], VerifierReward)):
                rate, _ = disagreement_rate(values[jn], values[vn])
                metrics[f"rewards/disagreement/{jn}_vs_{vn}"] = float("nan") if rate is None else rate
        return RewardScores(names, per, rewards, metrics)

    def combine(self, per: Tensor, names: Sequence[str]) -> Tensor:
        """The weighted sum ``[N]`` of per-reward values ``per`` ``[N, K]`` (``names``: their rewards) over
        those that apply (NaN where none does)."""
        w = torch.tensor([self.weights[name] for name in names], dtype=torch.float64)
        rewards = (per * w).nansum(dim=1)
        rewards[torch.isnan(per).all(dim=1)] = float("nan")
        return rewards

    def subset(self, names: Sequence[str]) -> "RewardSet":
        """The rewards ``names`` of this set, with their weights (the callables shared, not copied)."""
        return RewardSet({n: self.rewards[n] for n in names}, {n: self.weights[n] for n in names})

    def close(self) -> None:
        for fn in self.rewards.values():
            if hasattr(fn, "close"):
                fn.close()


def load_target(path: str, where: str = "reward") -> Callable[..., Any]:
    """The callable a dotted path names (``pkg.module.fn`` or ``pkg.module.Class.method``)."""
    module_name, _, attr = path.rpartition(".")
    parts: list[str] = []
    while module_name:
        try:
            obj: Any = importlib.import_module(module_name)
            break
        except ModuleNotFoundError as e:
            if e.name is None or not module_name.startswith(e.name):
                raise  # a module the target imports is missing: not a bad path
            module_name, _, head = module_name.rpartition(".")
            parts.insert(0, head)
    else:
        raise ValueError(f"{where}._target_={path!r}: no importable module in that path")
    for name in [*parts, attr]:
        if not hasattr(obj, name):
            raise ValueError(f"{where}._target_={path!r}: {obj.__name__!r} has no attribute {name!r}")
        obj = getattr(obj, name)
    if not callable(obj):
        raise ValueError(f"{where}._target_={path!r} is not callable")
    return obj


REWARD_KINDS: Registry[Callable[..., Any]] = Registry(
    "objective.rewards.<name>.type", error=ValueError,
    doc="a reward's type: a factory whose keyword parameters (less where, cache_dir) are the reward's keys")


def reward_keys(factory: Callable[..., Any]) -> set[str]:
    """The keys a reward of this kind takes: type, weight and the factory's keyword parameters."""
    return {"type", "weight"} | {p for p in inspect.signature(factory).parameters if p not in ("where", "cache_dir")}


@REWARD_KINDS.register("verifier", doc="the nested-rule checks of rolemrc.eval.verifiers (mode: all | fraction)")
def _verifier(*, where: str, cache_dir: Any, mode: str = "all") -> VerifierReward:
    return VerifierReward(mode)


@REWARD_KINDS.register("judge", doc="the five-dimension LLM judge (judge: a judge config, as evaluate.py's)")
def _judge(*, where: str, cache_dir: Any, judge: Any = None, dimension: str | None = None, on_failure: str = "raise",
           wait_s: float = 30.0, max_waits: int | None = 10) -> JudgeReward:
    if judge is None:
        raise ValueError(f"{where}.judge is required (a judge config, as evaluate.py's judge:)")
    return JudgeReward(judge, cache_dir=cache_dir, dimension=dimension, on_failure=on_failure,
                       wait_s=float(wait_s), max_waits=max_waits, where=where)


@REWARD_KINDS.register("reward_model", doc="a local sequence-classification model's logit (path: its folder)")
def _reward_model(*, where: str, cache_dir: Any, path: str | None = None, tokenizer: str | None = None,
                  batch_size: int = 8, device: str | None = None, dtype: str = "float32",
                  label: int | str | None = None, trust_remote_code: bool = False) -> RewardModelReward:
    if path is None:
        raise ValueError(f"{where}.path is required (a sequence-classification model folder, as model.path)")
    return RewardModelReward(path, tokenizer=tokenizer, batch_size=batch_size, device=device, dtype=dtype,
                             label=label, trust_remote_code=bool(trust_remote_code), where=where)


def build_rewards(spec: Mapping[str, Mapping[str, Any]], *, cache_dir: str | Path | None = None,
                  prefix: str = "rewards") -> RewardSet:
    """A :class:`RewardSet` from ``{name: {type: <a REWARD_KINDS name>, weight, ...}}`` or
    ``{name: {_target_: dotted.path, weight, **kwargs}}`` (the kwargs bound to the callable).
    Unknown keys and types are ValueErrors naming ``<prefix>.<name>.<key>`` (``objective=grpo``:
    ``objective.rewards``), as the judge reward's errors do."""
    rewards: dict[str, Callable[..., Sequence[float | None]]] = {}
    weights: dict[str, float] = {}
    for name, raw in spec.items():
        where = f"{prefix}.{name}"
        entry = dict(raw)
        weights[name] = float(entry.get("weight", 1.0))
        if "_target_" in entry:
            if "type" in entry:
                raise ValueError(f"{where}: give either type or _target_, not both")
            kwargs = {k: v for k, v in entry.items() if k not in ("_target_", "weight")}
            fn = load_target(str(entry["_target_"]), where)
            rewards[name] = functools.partial(fn, **kwargs) if kwargs else fn
            continue
        factory = REWARD_KINDS.get(entry.get("type"), where=f"{where}.type", hint=" (or give _target_)")
        known = reward_keys(factory)
        unknown = sorted(set(entry) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(f'{where}.{k}' for k in unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        rewards[name] = factory(where=where, cache_dir=cache_dir,
                                **{k: v for k, v in entry.items() if k not in ("type", "weight")})
    return RewardSet(rewards, weights)
