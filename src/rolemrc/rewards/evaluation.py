"""``evaluate.py model.path=<reward model>`` (evaluate.py sends such a path here): a reward model (an ``AutoModelForSequenceClassification``
folder with one label, what ``objective=reward`` exports) scored on held-out preference pairs.

The pairs are ``data.pairs_val`` when given, else the ``data.val_fraction`` of ``data.pairs`` that a
training run with the same ``seed`` holds out (never trained on). Each side is scored as GRPO's
``reward_model`` reward scores a completion (:class:`rolemrc.rewards.reward_model.RewardModelReward`:
the whole conversation, the reward model's chat template); a pair counts as right when the chosen
side scores above the rejected one (TRL's ``accuracy``). Writes ``<out_dir>/metrics.json``
(accuracy, mean margin, pairs; the same per RoleMRC task where the pairs carry one) and
``summary.md``.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

from rolemrc.config import Replier
from rolemrc.data.readers import read_examples
from rolemrc.errors import ConfigError
from rolemrc.fileio import atomic_write_json
from rolemrc.rewards.reward_model import RewardModelReward

log = logging.getLogger(__name__)


def is_reward_model(path: Any) -> bool:
    """Whether ``path`` is a local model folder whose config names a sequence-classification architecture."""
    if not path:
        return False
    config = Path(str(path)).expanduser() / "config.json"
    if not config.is_file():
        return False
    try:
        archs = json.loads(config.read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any(str(a).endswith("ForSequenceClassification") for a in archs)


def held_out_pairs(r: Replier) -> list[Any]:
    """``data.pairs_val``, else the held-out ``data.val_fraction`` of ``data.pairs`` (seed ``r.seed``)."""
    data = r.data
    if data.get("pairs_val"):
        pairs, _ = read_examples(list(data.pairs_val), "pairs", data.on_error, int(r.seed))
        return pairs
    if not data.get("pairs") or not float(data.val_fraction) > 0:
        raise ConfigError(f"model.path={r.model.path} is a reward model, scored on held-out preference pairs: "
                          f"data={data.name} has none (set data.pairs_val=[{{path: <pairs.jsonl>}}], or data.pairs "
                          "with data.val_fraction > 0)")
    _, report = read_examples(list(data.pairs), "pairs", data.on_error, int(r.seed), holdout=float(data.val_fraction))
    if not report.held_out:
        raise ConfigError(f"data.val_fraction={data.val_fraction} holds out no pair of data.pairs: set data.pairs_val")
    return list(report.held_out)


def _scores(chosen: list[float], rejected: list[float]) -> dict[str, Any]:
    margins = [c - r for c, r in zip(chosen, rejected, strict=True)]
    n = len(margins)
    return {"pairs": n, "accuracy": sum(m > 0 for m in margins) / n, "margin": sum(margins) / n}


def run_reward_model(r: Replier, limit: int | None = None) -> dict[str, Any]:
    """Score the reward model at ``r.model.path`` on held-out pairs (the first ``limit``); returns the metrics."""
    pairs = held_out_pairs(r)
    if limit:
        pairs = pairs[: int(limit)]
    out_dir = Path(r.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    m = r.model
    reward = RewardModelReward(m.path, tokenizer=m.get("tokenizer"), batch_size=int(r.generation.batch_size),
                               device=r.generation.device, dtype=m.dtype, trust_remote_code=bool(m.trust_remote_code),
                               where="model")
    log.info("scoring reward model %s on %d held-out pairs", m.path, len(pairs))
    prompts = [p.prompt for p in pairs]
    chosen = reward(prompts=prompts, completions=[p.chosen for p in pairs])
    rejected = reward(prompts=prompts, completions=[p.rejected for p in pairs])
    reward.close()
    metrics: dict[str, Any] = {"model": str(m.path), **_scores(chosen, rejected)}
    by_task: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for p, c, r in zip(pairs, chosen, rejected, strict=True):
        if p.task:
            by_task[p.task][0].append(c)
            by_task[p.task][1].append(r)
    metrics["by_task"] = {task: _scores(*sides) for task, sides in sorted(by_task.items())}
    atomic_write_json(out_dir / "metrics.json", metrics)
    lines = [f"# Reward model: {m.path}", "",
             f"{metrics['pairs']} held-out pairs: accuracy {metrics['accuracy']:.4f}, mean margin {metrics['margin']:.4f}",
             ""]
    if metrics["by_task"]:
        lines += ["| task | pairs | accuracy | margin |", "|---|---|---|---|"]
        lines += [f"| {t} | {s['pairs']} | {s['accuracy']:.4f} | {s['margin']:.4f} |" for t, s in metrics["by_task"].items()]
    (out_dir / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"reward model: accuracy {metrics['accuracy']:.4f} on {metrics['pairs']} held-out pairs "
          f"(mean margin {metrics['margin']:.4f}); summary: {out_dir / 'summary.md'}", flush=True)
    return metrics
