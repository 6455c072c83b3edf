"""``callbacks=judge_scores``: every N validation rounds, greedy replies to a fixed, task-balanced
subset of the test items -> reference metrics -> LLM judge -> scalars, a samples table and files.

    python train.py callbacks=[default,judge_scores] logger=wandb
    python train.py callbacks=[default,judge_scores] callbacks.judge_scores.judge.backend=openai \
        callbacks.judge_scores.judge.model=gpt-4o-mini

Logged at the trainer's global step, to every logger (``logger.log_metrics``):

- ``gen/<metric>``: mean of each reference metric (default BLEU, ROUGE-1, ROUGE-L), ``gen/n_tokens``
  (mean new tokens) and ``gen/cut_fraction`` (replies cut at ``max_new_tokens``);
- ``judge/<DIM>/accuracy`` over parseable verdicts only (absent when there is none: a failed or
  unparseable judgement is counted, never scored 0), ``judge/<DIM>/n_ok``, ``n_unparseable``,
  ``n_failed``, ``n_budget_exhausted`` (the names ``evaluate.py`` uses);
- ``judge_scores/seconds``: what the round cost;
- the samples as a table ``judge_scores/samples`` (W&B only).

Written into ``<out_dir>`` (default ``<run_dir>/callbacks/judge_scores``): ``step_<n>.jsonl``, one
line per item (prompt, reply, reference, metrics, verdicts), and ``step_<n>.json``, the summary.

Ranks. Scalars go to the loggers directly (not ``pl_module.log``) because only rank 0 has them.

- single device / DDP: rank 0 generates, scores and logs; the other ranks go on and wait for it
  at their next collective (gradient all-reduce).
- FSDP2 (parameters are DTensors): every forward all-gathers weights from every rank, so every
  rank generates for the same prompts, with ``synced_gpus`` so a rank whose replies end early
  keeps stepping until all are done. The judge is rank 0's alone (an hf judge loaded from
  ``judge.model`` is an unsharded copy on rank 0's device), except the hf judge that is the model
  being trained, whose forwards again need every rank: rank 0's replies are broadcast first so
  every rank asks the same judge prompts. Only rank 0 writes and logs.

Either way the waiting ranks sit in a collective for as long as rank 0 works: keep ``n_items``,
``max_new_tokens`` and the judge's latency well inside the process-group timeout.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger
from omegaconf import OmegaConf
from torch import nn

from rolemrc.config import plain
from rolemrc.eval.generation import item_id
from rolemrc.rollout.hf import greedy_generate_ids, pad_id_of, stop_token_ids
from rolemrc.eval.judge import (
    STATUSES,
    DimensionSummary,
    HFBackend,
    Judge,
    Verdict,
    aggregate,
    check_judge,
    judge_backend,
    judge_config,
    judge_items,
    make_judge,
    uses_evaluated_model,
)
from rolemrc.eval.metrics import METRICS, check_metrics, compute_metrics
from rolemrc.fileio import atomic_write_text
from rolemrc.data.test_items import generation_prompts, load_test_items
from rolemrc.tasks import TASKS, balanced_subset

log = logging.getLogger(__name__)

DEFAULT_METRICS: tuple[str, ...] = ("bleu", "rouge1", "rougeL")  # cheap: no model, no corpus download


def is_sharded(model: nn.Module) -> bool:
    """True under FSDP2 (and tensor parallelism): parameters are DTensors, so a forward on one
    rank waits for the all-gathers of every other rank."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def chat_of(trainer: L.Trainer) -> Any:
    """The run's :class:`~rolemrc.data.templates.ChatFormat`, from the datamodule."""
    chat = getattr(trainer.datamodule, "chat", None)
    if chat is None:
        raise RuntimeError("this callback renders prompts with the training chat template: it needs the "
                           "trainer's datamodule to be a rolemrc ChatDataModule (with .chat)")
    return chat


def test_sources(explicit: Any, trainer: L.Trainer) -> tuple[list[dict[str, Any]], str]:
    """(test sources, on_error): the callback's own ``test`` or the run's ``data.test`` (from the
    trainer's datamodule, whose ``cfg`` is the data config)."""
    data = getattr(getattr(trainer, "datamodule", None), "cfg", None)
    on_error = str(data.on_error) if data is not None else "raise"
    if explicit is not None:
        return list(plain(explicit)), on_error
    if data is None or not getattr(data, "test", None):
        raise ValueError("no test sources: give the callback `test: [{path: ...}]` (the run's data config has no test)")
    return [plain(source) for source in data.test], on_error  # DataConfig: SourceConfig items


@contextmanager
def generation_mode(trainer: L.Trainer, model: nn.Module) -> Iterator[None]:
    """Eval mode, no grad and the run's precision (autocast under ``*-mixed``) for the block;
    train mode comes back after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), trainer.precision_plugin.forward_context():
            yield
    finally:
        model.train(was_training)


def judge_scalars(table: Mapping[str, DimensionSummary]) -> dict[str, float]:
    """``judge/<DIM>/accuracy`` (only where some verdict was parseable) and the status counts."""
    out: dict[str, float] = {}
    for dim, s in table.items():
        if s.accuracy is not None:
            out[f"judge/{dim}/accuracy"] = float(s.accuracy)
        if s.paper_score is not None:  # judge.protocol=paper: the authors' figure
            out[f"judge/{dim}/paper_score"] = float(s.paper_score)
        for status in STATUSES:
            out[f"judge/{dim}/n_{status}"] = float(getattr(s, f"n_{status}"))
    return out


class JudgeScores(L.Callback):
    """Generate on a fixed test subset every ``every_n_val`` validation rounds; score and log.

    Args:
        every_n_val: run on every N-th validation round (sanity checks are not counted).
        n_items: test items, taken round-robin over tasks (``balanced_subset``).
        max_new_tokens, batch_size: greedy generation (hf ``generate``, left-padded batches).
        metrics: reference metrics (names of :data:`rolemrc.eval.metrics.METRICS`); [] for none.
        judge: :class:`rolemrc.config.JudgeConfig` fields (the keys of ``conf/judge/*.yaml``, plus
            ``device``); ``backend: none`` skips judging.
        test: test sources (``[{path: ...}]``); None: the training config's ``data.test``.
        out_dir: where the files go; None: ``<run_dir>/callbacks/judge_scores``.
        table_key: the W&B table's key.
    """

    def __init__(
        self,
        every_n_val: int = 1,
        n_items: int = 18,
        max_new_tokens: int = 128,
        batch_size: int = 8,
        metrics: Sequence[str] = DEFAULT_METRICS,
        judge: Mapping[str, Any] | None = None,
        test: Sequence[Mapping[str, Any]] | None = None,
        out_dir: str | None = None,
        table_key: str = "judge_scores/samples",
    ) -> None:
        if every_n_val < 1 or n_items < 1 or max_new_tokens < 1 or batch_size < 1:
            raise ValueError("judge_scores: every_n_val, n_items, max_new_tokens and batch_size must be >= 1")
        self.metrics = list(plain(metrics) or [])
        unknown = sorted(set(self.metrics) - set(METRICS))
        if unknown:
            raise ValueError(f"judge_scores.metrics: unknown {unknown}; known: {', '.join(METRICS)}")
        # METEOR's WordNet and Punkt data, BERTScore's encoder: now, not at the first validation round hours later
        check_metrics(self.metrics)
        # An unknown key, a bad backend or a missing model name fails here, naming the key.
        self.judge = judge_config(plain(judge) or {}, where="judge_scores.judge")
        self.every_n_val = every_n_val
        self.n_items = n_items
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.test = plain(test)
        self.out_dir = out_dir
        self.table_key = table_key
        self.rounds = 0  # validation rounds seen (checkpointed, so a resume keeps the rhythm)
        self._items: list[Any] = []
        self._ids: list[str] = []
        self._prompts: list[list[int]] = []
        self._chat: Any = None
        self._stops: list[int] = []
        self._out = Path(out_dir) if out_dir else Path(".")  # setup() names the default, the run folder's
        self._external_judge: Judge | None = None  # hf judge from a folder or openai, built once

    # ---- lifecycle -----------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._chat = chat_of(trainer)
        sources, on_error = test_sources(self.test, trainer)
        items, _ = load_test_items(OmegaConf.create({"test": sources, "on_error": on_error}))
        self._items = balanced_subset(items, self.n_items)
        self._ids = [item_id(k, it.task, it.question) for k, it in enumerate(self._items)]
        # From the run's data store of these questions' prompts, as evaluate.py reads them
        # (data.cache=false: encoded here).
        data = getattr(trainer.datamodule, "cfg", None)
        store = {"cache": bool(getattr(data, "cache", True)), "cache_dir": getattr(data, "cache_dir", None),
                 "test": sources}
        self._prompts = generation_prompts(OmegaConf.create(store), list(self._items), self._chat)
        self._stops = stop_token_ids(self._chat.tokenizer, self._chat.eot)
        default_out = Path(trainer.default_root_dir) / "callbacks" / "judge_scores"
        self._out = Path(self.out_dir) if self.out_dir else default_out
        if trainer.is_global_zero:
            check_judge(self.judge, where="judge_scores.judge")  # the API key's variable, before training
        log.info("judge_scores: %d test items over %d tasks, every %d validation round(s), judge %s",
                 len(self._items), len({it.task for it in self._items}), self.every_n_val, self.judge.backend)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._external_judge is not None:
            self._external_judge.close()
            self._external_judge = None

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rounds = int(state_dict.get("rounds", 0))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.rounds += 1
        if self.rounds % self.every_n_val == 0:
            self.score(trainer, pl_module)

    # ---- one round -----------------------------------------------------------------------
    def score(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float] | None:
        """Generate, judge, score, write and log; returns the scalars on rank 0 (None elsewhere)."""
        model = pl_module.model
        everywhere = is_sharded(model)
        if not (everywhere or trainer.is_global_zero):
            return None
        start = time.perf_counter()
        step = trainer.global_step
        tokenizer = self._chat.tokenizer
        with generation_mode(trainer, model):
            new_ids = greedy_generate_ids(
                model, self._prompts, batch_size=self.batch_size, max_new_tokens=self.max_new_tokens, pad_id=pad_id_of(tokenizer),
                stop_ids=self._stops, synced_gpus=True if everywhere else None,
            )
        replies = [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in new_ids]
        if everywhere and uses_evaluated_model(self.judge):  # the model being trained judges itself
            # Tiny numeric differences between ranks must not give them different judge prompts.
            replies = trainer.strategy.broadcast(replies, src=0)
        verdicts = self.run_judge(trainer, pl_module, replies, everywhere, step)
        if not trainer.is_global_zero:
            return None

        refs = [it.reference for it in self._items]
        scores = compute_metrics(replies, refs, metrics=self.metrics) if self.metrics else None
        table = aggregate(verdicts) if verdicts is not None else {}
        stops = set(self._stops)
        scalars: dict[str, float] = {
            "gen/n_tokens": sum(map(len, new_ids)) / len(new_ids),
            "gen/cut_fraction": sum(not ids or ids[-1] not in stops for ids in new_ids) / len(new_ids),
        }
        if scores is not None:
            scalars.update({f"gen/{name}": s["mean"] for name, s in scores.summary().items()})
        scalars.update(judge_scalars(table))
        scalars["judge_scores/seconds"] = time.perf_counter() - start

        rows = self.sample_rows(step, replies, new_ids, scores, verdicts)
        self.write(step, rows, scores, table, scalars)
        self.log_all(trainer, step, scalars, rows)
        log.info("judge_scores at step %d: %s", step, ", ".join(f"{k} {v:.4g}" for k, v in scalars.items()))
        return scalars

    def run_judge(self, trainer: L.Trainer, pl_module: L.LightningModule, replies: list[str], everywhere: bool,
                  step: int) -> list[Verdict] | None:
        """Verdicts for every (RoleMRC item, dimension), or None when there is no judge (or on a rank
        that takes no part)."""
        if judge_backend(self.judge) is None:
            return None
        if not (uses_evaluated_model(self.judge) and everywhere) and not trainer.is_global_zero:
            return None
        judged = [k for k, it in enumerate(self._items) if it.task in TASKS]  # RoleBench items are not judged
        jitems = judge_items([self._items[k] for k in judged], [replies[k] for k in judged],
                             [self._ids[k] for k in judged])
        if not uses_evaluated_model(self.judge):
            return self.external_judge(pl_module).judge(jitems)
        model = pl_module.model
        # The weights change every round: the step in the model id keeps answers apart, and no
        # cache is kept (under FSDP a cache hit on one rank would skip forwards the others run).
        backend = HFBackend(model, self._chat.tokenizer, model_id=f"model in training, step {step}",
                            max_new_tokens=self.judge.max_tokens, synced_gpus=True if everywhere else None)
        with generation_mode(trainer, model):
            return Judge(backend, cache_dir=None, show_reference=self.judge.show_reference).judge(jitems)

    def external_judge(self, pl_module: L.LightningModule) -> Judge:
        """The hf judge loaded from ``judge.model``, or the openai one: built at first use, kept."""
        if self._external_judge is None:
            judge = make_judge(self.judge, cache_dir=self._out / "judge_cache", device=str(pl_module.device),
                               where="judge_scores.judge")
            assert judge is not None
            self._external_judge = judge
        return self._external_judge

    # ---- outputs -------------------------------------------------------------------------
    def sample_rows(self, step: int, replies: list[str], new_ids: list[list[int]], scores: Any,
                    verdicts: list[Verdict] | None) -> list[dict[str, Any]]:
        stops = set(self._stops)
        by_item: dict[str, dict[str, dict[str, Any]]] = {}
        for v in verdicts or []:
            if not v.repeat:  # judge.protocol=paper asks PI twice; the row shows the first answer
                by_item.setdefault(v.item_id, {})[v.dimension] = {"verdict": v.verdict, "status": v.status}
        rows = []
        for k, (it, reply) in enumerate(zip(self._items, replies, strict=True)):
            rows.append({
                "step": step,
                "id": self._ids[k],
                "origin": it.origin,
                "task": it.task,
                "prompt": it.question[-1]["content"],
                "reply": reply,
                "reference": it.reference,
                "n_tokens": len(new_ids[k]),
                "stopped": bool(new_ids[k]) and new_ids[k][-1] in stops,
                "metrics": {m: v[k] for m, v in scores.per_sample.items()} if scores is not None else {},
                "judge": by_item.get(self._ids[k], {}),
            })
        return rows

    def write(self, step: int, rows: list[dict[str, Any]], scores: Any, table: Mapping[str, DimensionSummary],
              scalars: Mapping[str, float]) -> None:
        atomic_write_text(self._out / f"step_{step}.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        summary = {
            "step": step,
            "round": self.rounds,
            "items": len(rows),
            "generation": {"max_new_tokens": self.max_new_tokens, "greedy": True},
            "metrics": scores.summary() if scores is not None else {},
            "metrics_info": scores.info if scores is not None else {},
            "judge": {"settings": {k: v for k, v in asdict(self.judge).items() if k != "api_key_env"},
                      "dimensions": {d: s.to_dict() for d, s in table.items()}},
            "scalars": dict(scalars),
        }
        atomic_write_text(self._out / f"step_{step}.json", json.dumps(summary, indent=2, ensure_ascii=False) + "\n")

    def log_all(self, trainer: L.Trainer, step: int, scalars: Mapping[str, float], rows: list[dict[str, Any]]) -> None:
        """Scalars to every logger; the samples table to W&B."""
        columns = ["step", "id", "task", "prompt", "reply", "reference", *self.metrics, "judge"]
        for lg in trainer.loggers:
            lg.log_metrics(dict(scalars), step=step)
            if isinstance(lg, WandbLogger):
                data = [[r["step"], r["id"], r["task"], r["prompt"], r["reply"], r["reference"],
                         *(r["metrics"].get(m) for m in self.metrics),
                         " ".join(f"{d}:{j['verdict'] if j['status'] == 'ok' else j['status']}"
                                  for d, j in r["judge"].items())]
                        for r in rows]
                lg.log_table(key=self.table_key, columns=columns, data=data, step=step)
            lg.save()
