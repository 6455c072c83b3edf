"""The ``judge`` reward: rolemrc's five-dimension judge (any backend of ``eval.judge.make_judge``).

Each completion is judged on the dimensions its ``task`` is scored on (``rolemrc.tasks``), or on
``dimension`` alone; its reward is the mean of its verdicts (1/0), ``None`` where the task has
no such dimension. Answers come through the judge's cache, so a rerun or a retry asks only for
what is missing. A judgement without a verdict (server down, budget spent, no verdict after the
judge's retries) is never scored 0: ``on_failure="raise"`` stops with :class:`JudgeRewardError`
naming the counts, ``"wait"`` asks again for the missing ones after ``wait_s`` (at most
``max_waits`` times, then raises), ``"skip"`` gives that completion ``None`` (left out of the
means and of the advantages' baselines) and counts it in ``last_missing``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rolemrc.errors import UserError
from rolemrc.eval.judge import Judge, Verdict, judge_items, make_judge
from rolemrc.rewards.text import completion_texts
from rolemrc.tasks import Dimension

log = logging.getLogger(__name__)

JUDGE_ON_FAILURE: tuple[str, ...] = ("raise", "wait", "skip")


class JudgeRewardError(UserError, RuntimeError):
    """The judge reward could not obtain every verdict it needs."""


def _dimension(name: str | None) -> Dimension | None:
    if name is None:
        return None
    for d in Dimension:
        if name in (d.short, d.value):
            return d
    raise ValueError(f"unknown judge dimension {name!r}; known: {', '.join(d.short for d in Dimension)}")


class JudgeReward:
    """A reward from the judge; ``judge`` is a :class:`rolemrc.eval.judge.Judge` or a judge config
    (``JudgeConfig``, DictConfig or mapping, as ``evaluate.py``'s ``judge:``) given to ``make_judge``."""

    def __init__(self, judge: Judge | Any, *, cache_dir: str | Path | None = None, dimension: str | None = None,
                 on_failure: str = "raise", wait_s: float = 30.0, max_waits: int | None = 10,
                 where: str = "judge reward") -> None:
        if on_failure not in JUDGE_ON_FAILURE:
            raise ValueError(f"judge reward on_failure must be one of {', '.join(JUDGE_ON_FAILURE)}, got {on_failure!r}")
        self.dimension = _dimension(dimension)  # checked before a judge (maybe a model) is made
        if isinstance(judge, Judge):
            self.judge = judge
        else:
            made = make_judge(judge, cache_dir=cache_dir, where="judge reward")
            if made is None:
                raise ValueError("the judge reward needs a judge backend (hf or openai), got backend=none")
            self.judge = made
        self.on_failure, self.wait_s, self.max_waits = on_failure, wait_s, max_waits
        self.where = where  # how errors name it: its config key (rewards.<name>)
        self.last_missing: Counter[str] = Counter()  # judgements without a verdict in the last call, by status

    def __call__(self, *, prompts: Sequence[Sequence[Mapping[str, Any]]], completions: Sequence[Any],
                 task: Sequence[str] | None = None, reference: Sequence[str | None] | None = None,
                 **columns: Any) -> list[float | None]:
        if task is None:
            raise ValueError("the judge reward needs each prompt's task (the `task` column)")
        refs = [None] * len(completions) if reference is None else list(reference)
        records = [{"task": t, "question": list(p), "reference": r} for p, t, r in zip(prompts, task, refs, strict=True)]
        items = judge_items(records, completion_texts(completions))
        if self.dimension is not None:
            items = [it for it in items if it.dimension == self.dimension]
        verdicts = self._judge(items)
        scores: dict[int, list[int]] = {}
        self.last_missing = Counter()
        for v in verdicts:
            if v.status == "ok":
                scores.setdefault(int(v.item_id), []).append(int(v.verdict))  # type: ignore[arg-type]
            else:
                self.last_missing[v.status] += 1
                scores.setdefault(int(v.item_id), [])
        out: list[float | None] = []
        for i in range(len(completions)):
            got = scores.get(i)
            # skipped (or not judged on this dimension): None, never 0; partly judged: only if all verdicts came
            complete = got is not None and len(got) == sum(1 for it in items if int(it.item_id) == i)
            out.append(sum(got) / len(got) if got and complete else None)
        if self.last_missing:
            log.warning("judge reward: %s judgements without a verdict; those completions are not scored",
                        dict(self.last_missing))
        return out

    def _judge(self, items: list) -> list[Verdict]:
        waits = 0
        while True:
            verdicts = self.judge.judge(items)  # answers already obtained come from the cache
            missing = Counter(v.status for v in verdicts if v.status != "ok")
            if not missing or self.on_failure == "skip":
                return verdicts
            if self.on_failure == "raise" or (self.max_waits is not None and waits >= self.max_waits):
                errors = sorted({v.error for v in verdicts if v.error})[:3]
                counts = ", ".join(f"{n} {status}" for status, n in sorted(missing.items()))
                after = f" after {waits} wait(s) of {self.wait_s:g} s" if waits else ""
                key = f"{self.where}." if self.where != "judge reward" else "rewards.<name>."
                advice = (f"{key}on_failure=wait asks again for the missing ones, skip leaves them unscored"
                          if self.on_failure == "raise" else f"raise {key}max_waits or wait_s, or set on_failure=skip")
                raise JudgeRewardError(
                    f"{self.where}: {sum(missing.values())} of {len(verdicts)} judgements have no verdict{after} "
                    f"({counts}){': ' + '; '.join(errors) if errors else ''}. The step is not scored; {advice}")
            waits += 1
            log.warning("judge reward: %s judgements without a verdict; asking again in %.0f s (wait %d%s)",
                        dict(missing), self.wait_s, waits, f" of {self.max_waits}" if self.max_waits else "")
            time.sleep(self.wait_s)

    def close(self) -> None:
        self.judge.close()
