"""objective=grpo on two CPU ranks under FSDP2 (sharded policy and reference copy, generate with
synced decoding steps) and DDP: the same rollouts, rewards and KL step for step; with
``num_iterations=2`` and ``scale_rewards=batch``, the DDP run equals one rank given the same global
batch and the same completions (the reuse, the old log-probs, the batch std and the logged metrics
are global), and its completion metrics equal those of the completions it sampled."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from tests.conftest import ROOT
from tests.train.helpers import metric_rows

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STEPS = 4  # num_iterations=2: rollouts sampled at steps 1 and 3, trained again at steps 2 and 4
# Adam's eps=1 makes its update ~ lr x gradient (not ~ lr x sign, which float noise in a ~0 gradient
# could flip), so two ways of summing the same gradient give the same weights
ARGS = ["objective=grpo", "data.prompts=[{path: ${asset:sample/test.jsonl}}]", "data.max_prompt_length=48",
        "data.batch_size=2", "objective.num_generations=3", "objective.max_completion_length=6",
        f"trainer.max_steps={STEPS}", "objective.beta=0.04", "objective.num_iterations=2",
        "objective.scale_rewards=batch", "objective.epsilon=0.05", "optim.lr=1.0", "optim.eps=1.0",
        "optim.warmup_ratio=0",
        "optim.scheduler=constant", "trainer.enable_progress_bar=false", "export.enabled=false",
        "data.val_fraction=0", "+objective.rewards.vowels._target_=tests.train.test_grpo.vowel_reward"]
EVERY_STEP = ["callbacks.checkpoint.every_n_train_steps=1", "callbacks.checkpoint.save_top_k=-1"]
TWO_RANKS = ["trainer.devices=2", "trainer.accelerator=cpu",
             "+callbacks.record._target_=tests.train.test_grpo_distributed.RecordRollouts"]


class RecordRollouts(L.Callback):
    """Saves what ``generate`` sampled on this rank (``rollouts_rank<r>.pt`` in the run folder): per
    generation, each prompt's tokens (unpadded) and its completions' rows. Changes nothing."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        real, records = pl_module.generate, []

        def generate(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sample: bool = True) -> torch.Tensor:
            new_ids = real(prompt_ids, prompt_mask, sample)
            if sample:
                records.append(([ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask)], new_ids.cpu()))
            return new_ids

        pl_module.generate = generate
        self.records = records

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.save({"stop_ids": list(pl_module.stop_ids), "records": self.records},
                   Path(trainer.default_root_dir) / f"rollouts_rank{trainer.global_rank}.pt")


def train(run_dir: Path, *overrides: str) -> list[dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "train.py", *ARGS, *TWO_RANKS, f"hydra.run.dir={run_dir}", *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "returned a view tensor" not in proc.stderr
    return [r for r in metric_rows(run_dir) if "train/loss" in r]


def replayed(run_dir: Path, width: int) -> tuple[dict[tuple, list[torch.Tensor]], list[list[Any]], set[int]]:
    """Both ranks' recorded completions: (generation, prompt tokens) -> its rows in sampled order,
    right-padded to ``width`` with a stop token (rows narrower than ``width`` all stopped before);
    per generation, every completion's (prompt tokens, row); and the stop token ids."""
    table: dict[tuple, list[torch.Tensor]] = {}
    per_generation: list[list[Any]] = []
    for rank in (0, 1):
        saved = torch.load(run_dir / f"rollouts_rank{rank}.pt", weights_only=True)
        stops, stop = set(saved["stop_ids"]), saved["stop_ids"][0]
        for k, (prompts, new_ids) in enumerate(saved["records"]):
            rows = torch.cat([new_ids, torch.full((len(new_ids), width - new_ids.shape[1]), stop)], dim=1)
            while len(per_generation) <= k:
                per_generation.append([])
            for prompt, row in zip(prompts, rows):
                table.setdefault((k, tuple(prompt)), []).append(row)
                per_generation[k].append((prompt, row))
    return table, per_generation, stops


def test_fsdp2_and_ddp_give_the_same_rollouts_and_ddp_reuse_equals_one_rank(tmp_path: Path, monkeypatch) -> None:
    fsdp = train(tmp_path / "fsdp", "strategy=fsdp", "strategy.param_dtype=null")
    ddp = train(tmp_path / "ddp", "strategy=ddp", *EVERY_STEP)
    assert len(fsdp) == len(ddp) == STEPS
    # Resumed from step 1, in the middle of a reuse: each rank gets back its own kept rollouts and
    # its own sampling RNG (seeded by rank), so steps 2-4 are the uninterrupted run's
    step1 = next((tmp_path / "ddp" / "checkpoints").glob("*step=1.ckpt"))
    resumed = train(tmp_path / "resumed", "strategy=ddp", f"ckpt_path='{step1}'")
    assert [r["step"] for r in resumed] == [r["step"] for r in ddp[1:]]
    for key in ("train/loss", "train/reward", "train/kl", "train/num_tokens", "train/completions/mean_length"):
        assert [r[key] for r in resumed] == pytest.approx([r[key] for r in ddp[1:]], rel=1e-5, abs=1e-7), key
    for key in ("train/reward", "train/rewards/vowels/mean", "train/completions/mean_length", "train/kl",
                "train/entropy", "train/num_tokens", "train/clip_ratio/region_mean"):
        assert [r[key] for r in fsdp] == pytest.approx([r[key] for r in ddp], abs=1e-5), key
    assert fsdp[1]["train/kl"] > 0  # the policy moved off the reference after one step
    assert ddp[0]["train/reward"] == ddp[1]["train/reward"] != ddp[2]["train/reward"]  # step 2 reuses step 1's

    # One rank, 4 prompts a step (the two ranks' 2 + 2, by the sampler's stride), given the
    # completions the DDP ranks sampled: the same losses, metrics and weights
    from rolemrc.modules.grpo import GRPOModule
    from rolemrc.run.train import run
    from tests.conftest import FAST, compose_train

    table, per_generation, stops = replayed(tmp_path / "ddp", 6)
    calls: list[int] = []

    def replay(self: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sample: bool = True) -> torch.Tensor:
        k, seen, rows = len(calls), {}, []
        calls.append(self.trainer.global_step)
        for ids, m in zip(prompt_ids, prompt_mask):
            key = (k, tuple(ids[m.bool()].tolist()))
            rows.append(table[key][seen.setdefault(key, 0)])
            seen[key] += 1
        return torch.stack(rows)

    monkeypatch.setattr(GRPOModule, "generate", replay)
    one_dir = tmp_path / "one"
    run(compose_train([*FAST, *ARGS, "data.batch_size=4"], run_dir=one_dir))
    assert calls == [0, 2]
    one = [r for r in metric_rows(one_dir) if "train/loss" in r]
    assert len(one) == STEPS
    keys = [k for k in one[0] if k.startswith("train/") and k not in ("train/completion_tokens_per_s", "train/lr")]
    assert {"train/entropy", "train/num_tokens", "train/frac_reward_zero_std", "train/clip_ratio/low_min",
            "train/completions/mean_terminated_length"} <= set(keys)
    for key in keys:
        assert [r[key] for r in ddp] == pytest.approx([r[key] for r in one], rel=1e-4, abs=1e-6), key
    assert any(r["train/clip_ratio/region_mean"] > 0 for r in one[1::2])  # the reuses train off-policy
    ddp_state = torch.load(tmp_path / "ddp" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    one_state = torch.load(one_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    for name, w in one_state.items():
        torch.testing.assert_close(ddp_state[name], w, rtol=1e-4, atol=1e-5, msg=name)

    # The completion metrics and num_tokens are those of the completions sampled (every rank's; the
    # random tiny model may stop none of them: test_grpo.py checks a known mix of stopped and cut ones)
    seen_tokens = 0
    for k, completions in enumerate(per_generation):
        lengths, ended = [], []
        for prompt, row in completions:
            stop_at = next((i for i, t in enumerate(row.tolist()) if t in stops), None)
            lengths.append(6 if stop_at is None else stop_at + 1)
            if stop_at is not None:
                ended.append(stop_at + 1)
            seen_tokens += len(prompt) + lengths[-1]
        truncated = (len(lengths) - len(ended)) / len(lengths)
        ended = ended or [0]  # TRL's value when no completion ended
        row = ddp[2 * k]
        assert row["train/completions/mean_length"] == pytest.approx(sum(lengths) / len(lengths))
        assert (row["train/completions/min_length"], row["train/completions/max_length"]) == (min(lengths), max(lengths))
        assert row["train/completions/clipped_ratio"] == pytest.approx(truncated)
        assert row["train/completions/mean_terminated_length"] == pytest.approx(sum(ended) / len(ended))
        assert row["train/completions/min_terminated_length"] == min(ended)
        assert row["train/completions/max_terminated_length"] == max(ended)
        assert row["train/num_tokens"] == seen_tokens == ddp[2 * k + 1]["train/num_tokens"]
    assert len(per_generation) == 2 and all(len(c) == 4 * 3 for c in per_generation)
