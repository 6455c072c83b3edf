"""objective=grpo end to end: the step's loss against the pure functions on the same rollouts, a
short run's TRL metric names, exact resume of the rollouts, and the reference built only when beta > 0.
The step's loss, gradient and loss metrics are compared with TRL 1.16's own ``GRPOTrainer._compute_loss``
(tests/objectives/test_grpo_trl.py's stand-in trainer) on the same rollouts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from rolemrc.objectives.grpo import group_advantages
from rolemrc.run.train import run, setup
from tests.train.helpers import metric_rows, series

pytestmark = pytest.mark.xdist_group("grpo")

# The 54 sample test items as prompts; a reward every completion gets (the verifier applies to 12 only).
GRPO = ["objective=grpo", "data.prompts=[{path: ${asset:sample/test.jsonl}}]", "data.max_prompt_length=48",
        "data.batch_size=2", "objective.num_generations=3", "objective.max_completion_length=6",
        "data.val_fraction=0", "export.enabled=false", "optim.warmup_ratio=0", "optim.scheduler=constant",
        "+objective.rewards.vowels._target_=tests.train.test_grpo.vowel_reward"]


def vowel_reward(*, prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    """The fraction of vowels among a completion's characters (varies between random completions)."""
    assert len(prompts) == len(completions) and all(len(v) == len(completions) for v in columns.values())
    return [sum(ch in "aeiouAEIOU" for ch in c) / max(len(c), 1) for c in completions]


def by_hand_entropy(module: Any, batch: dict, new_ids: torch.Tensor) -> float:
    """TRL 1.16's ``entropy`` of fixed completions: ``entropy_from_logits`` of the model's plain
    logits / temperature at the completion tokens (up to the stop token), their token mean."""
    from trl.trainer.utils import entropy_from_logits

    g = module.objective.num_generations
    prompt_ids = batch["prompt_ids"].repeat_interleave(g, 0)
    prompt_mask = batch["prompt_mask"].repeat_interleave(g, 0)
    mask, _, _ = module.completions_from(new_ids)
    ids = torch.cat([prompt_ids, new_ids], 1)
    attention = torch.cat([prompt_mask, mask], 1)
    with torch.no_grad():
        logits = module.model(input_ids=ids, attention_mask=attention,
                              position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits.float()
    p = prompt_ids.shape[1]
    per_token = entropy_from_logits(logits[:, p - 1:-1] / module.objective.temperature)
    return float((per_token * mask).sum() / mask.sum())


def by_hand_logps(module: Any, batch: dict, new_ids: torch.Tensor) -> dict[str, Any]:
    """Fixed completions' per-token log-probs (policy, with gradient; reference), mask and advantages
    from the model's plain logits and the reward functions, as TRL's trainer hands them to its loss."""
    o = module.objective
    g = o.num_generations
    stops = torch.tensor(module.stop_ids)
    is_stop = torch.isin(new_ids, stops)
    mask = torch.zeros_like(new_ids)
    for i, row in enumerate(is_stop):
        end = int(row.int().argmax()) + 1 if bool(row.any()) else new_ids.shape[1]
        mask[i, :end] = 1
    texts = module.chat.tokenizer.batch_decode([r[m.bool()].tolist() for r, m in zip(new_ids, mask)],
                                               skip_special_tokens=True)
    prompts = [p for p in batch["prompts"] for _ in range(g)]
    rewards = torch.tensor(vowel_reward(prompts=prompts, completions=texts), dtype=torch.float64)
    per_reward = rewards.unsqueeze(1)
    if "verifier" in o.rewards:  # the default verifier reward, None where a prompt has no rule
        rules = [r for r in batch["columns"]["rule"] for _ in range(g)]
        from rolemrc.rewards import VerifierReward

        ver = VerifierReward("all")(prompts=prompts, completions=texts, rule=rules)
        per_reward = torch.stack([rewards, torch.tensor([float("nan") if v is None else v for v in ver],
                                                        dtype=torch.float64)], dim=1)
        rewards = per_reward.nansum(1)
    if o.multi_objective_aggregation == "normalize_then_sum":  # TRL's lines, restated
        from tests.objectives.test_grpo_trl import trl_normalize_then_sum

        adv = trl_normalize_then_sum(per_reward, torch.ones(per_reward.shape[1], dtype=torch.float64), g)[0].float()
    else:
        adv = group_advantages(rewards, g, o.scale_rewards).advantages.float()
    prompt_ids = batch["prompt_ids"].repeat_interleave(g, 0)
    prompt_mask = batch["prompt_mask"].repeat_interleave(g, 0)
    ids = torch.cat([prompt_ids, new_ids], 1)
    attention = torch.cat([prompt_mask, mask], 1)
    logits = module.model(input_ids=ids, attention_mask=attention,
                          position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits.float()
    p = prompt_ids.shape[1]
    logps = torch.log_softmax(logits[:, p - 1:-1] / o.temperature, -1).gather(-1, new_ids.unsqueeze(-1)).squeeze(-1)
    from trl.trainer.utils import entropy_from_logits

    with torch.set_grad_enabled(o.entropy_coef != 0 or o.use_adaptive_entropy):  # the bonus: with gradient
        entropies = entropy_from_logits(logits[:, p - 1:-1] / o.temperature)
    ref = None
    if o.beta > 0:
        with torch.no_grad():
            ref_logits = module.ref_model(input_ids=ids, attention_mask=attention,
                                          position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits.float()
        ref = torch.log_softmax(ref_logits[:, p - 1:-1] / o.temperature, -1).gather(
            -1, new_ids.unsqueeze(-1)).squeeze(-1)
    return {"logps": logps, "ref": ref, "mask": mask, "advantages": adv, "entropies": entropies}


def trl_step_loss(module: Any, inputs: dict[str, Any], old: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """TRL 1.16's ``GRPOTrainer._compute_loss`` (GRPOConfig's defaults but for the run's keys) of one
    micro-batch that is its whole step: its loss and logged metrics."""
    from tests.objectives.test_grpo_trl import TRL_DEFAULTS, trl_loss

    o = module.objective
    shared = {k: getattr(o, k) for k in TRL_DEFAULTS if hasattr(o, k)}  # every key we share with TRL
    return trl_loss(inputs["logps"], inputs["advantages"], inputs["mask"], old=old, ref=inputs["ref"],
                    entropies=inputs["entropies"], **shared)


def assert_step_equals_trl(module: Any, loss: torch.Tensor, expected: torch.Tensor, logged: dict[str, float],
                           params: list[torch.nn.Parameter]) -> None:
    """Our step's loss, gradient and every loss metric TRL logs."""
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    expected_grads = torch.autograd.grad(expected, params, allow_unused=True)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    # At a fresh rollout the ratio is 1, so the loss's value hides the log-probs: the gradient shows them
    assert sum(g.abs().sum() for g in grads if g is not None) > 0
    for g, e in zip(grads, expected_grads):
        assert (g is None) == (e is None)
        if g is not None:
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
    ours = module._loss_stats[-1]["metrics"]
    if "entropy_coef" in logged:  # logged at the step's end (after adaptive control's update), not per micro-batch
        assert logged.pop("entropy_coef") == pytest.approx(module.entropy_control.coef)
    shared = set(logged)
    assert "entropy" in shared and shared == set(ours)
    for name in shared:
        assert ours[name] == pytest.approx(logged[name], rel=1e-5, abs=1e-7, nan_ok=True), name


BETA = ["objective.beta=0.04", "objective.temperature=0.7"]


@pytest.mark.parametrize("extra", [["objective.loss_type=dapo"], ["objective.loss_type=grpo"],
                                   ["objective.loss_type=dr_grpo", "objective.scale_rewards=none"],
                                   ["objective.loss_type=dapo", *BETA, "objective.scale_rewards=batch"],
                                   ["objective.loss_type=grpo", *BETA, "objective.num_iterations=2",
                                    "objective.epsilon=0.05", "objective.delta=1.2"],
                                   ["objective.loss_type=dapo", *BETA, "objective.num_iterations=2",
                                    "objective.use_bias_correction_kl=false"],
                                   ["objective.loss_type=grpo", *BETA, "objective.num_iterations=2",
                                    "objective.importance_sampling_level=sequence"],
                                   ["objective.loss_type=cispo", "objective.epsilon_high=1.1", "objective.num_iterations=2",
                                    "objective.top_entropy_quantile=0.5", "objective.off_policy_mask_threshold=0.01"],
                                   ["objective.loss_type=sapo", "objective.num_iterations=2", *BETA],
                                   ["objective.loss_type=grpo", "objective.entropy_coef=0.3", "objective.num_iterations=2",
                                    "objective.top_entropy_quantile=0.5", *BETA],
                                   ["objective.loss_type=dapo", "objective.entropy_coef=-0.2"],
                                   ["objective.multi_objective_aggregation=normalize_then_sum"]])
def test_step_loss_equals_trls_loss_of_the_rollouts(train_cfg, monkeypatch, extra: list[str]) -> None:
    """The step's loss, gradient and loss metrics equal TRL's ``_compute_loss`` of the same rollouts
    (log-probs from the model's plain logits); with num_iterations=2 also on the reuse step, after
    the policy moved, with the first use's log-probs as TRL's old ones."""
    parts = setup(train_cfg(*GRPO, *extra))
    module, dm = parts.module, parts.datamodule
    module._chat = parts.chat
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    fresh = dict(batch)  # step_loss lays the rollouts into batch
    n = batch["prompt_ids"].shape[0] * module.objective.num_generations
    gen = torch.Generator().manual_seed(0)
    new_ids = torch.randint(10, module.chat.tokenizer.vocab_size, (n, 6), generator=gen)
    new_ids[0, 2] = module.stop_ids[0]  # one completion stops early: the mask ends at its stop token
    new_ids[4, 0] = module.stop_ids[0]
    monkeypatch.setattr(module, "generate", lambda *a, **k: new_ids.clone())

    def move(scale: float) -> None:
        with torch.no_grad():
            for p in module.model.parameters():
                p.add_(scale * torch.randn(p.shape, generator=gen))

    if module.objective.beta > 0:  # move the policy off the reference: the KL term has a value
        move(0.02)
    params = [p for p in module.model.parameters() if p.requires_grad]
    loss, _ = module.step_loss(batch)
    inputs = by_hand_logps(module, batch, new_ids)
    expected, logged = trl_step_loss(module, inputs)
    assert batch["advantages"].abs().sum() > 0  # the rollouts teach something: the test can fail
    assert_step_equals_trl(module, loss, expected, logged, params)
    # TRL's entropy: the token mean over the completion tokens of the entropy at logits / temperature
    entropy = module._loss_stats[-1]["metrics"]["entropy"]
    assert entropy == pytest.approx(by_hand_entropy(module, batch, new_ids), rel=1e-5)
    if module.objective.num_iterations == 1:
        return
    # the reuse step: the same rollouts after an update, the first use's log-probs as the old ones
    old = inputs["logps"].detach()
    move(0.05)
    reused = {**fresh, "step_use": 1}
    loss, _ = module.step_loss(reused)
    assert torch.equal(reused["input_ids"], batch["input_ids"])
    inputs = by_hand_logps(module, reused, new_ids)
    expected, logged = trl_step_loss(module, inputs, old=old)
    if "clip_ratio/region_mean" in logged and module.objective.epsilon < 0.1:  # off-policy: clipped tokens
        assert logged["clip_ratio/region_mean"] > 0
    assert_step_equals_trl(module, loss, expected, logged, params)


def fixed_generate(self: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sample: bool = True) -> torch.Tensor:
    """Completions that depend only on the prompt and the copy's place in its group (not on the
    batch they are generated in), of different lengths: some stop early, some are truncated."""
    rows, previous, copy = [], None, 0
    for ids, mask in zip(prompt_ids, prompt_mask):
        prompt = ids[mask.bool()]
        key = int((prompt * torch.arange(1, len(prompt) + 1)).sum()) % 100_003
        copy = copy + 1 if key == previous else 0
        previous = key
        gen = torch.Generator().manual_seed(key * 10 + copy)
        row = torch.randint(10, self.chat.tokenizer.vocab_size, (self.objective.max_completion_length,), generator=gen)
        stop = (key + 3 * copy) % 9
        if stop < len(row):
            row[stop] = self.stop_ids[0]
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("loss", [["objective.loss_type=dapo"], ["objective.loss_type=grpo"],
                                  ["objective.loss_type=dr_grpo", "objective.scale_rewards=none"]])
def test_same_update_however_the_step_is_cut(train_cfg, tmp_path: Path, monkeypatch, loss: list[str]) -> None:
    """4 prompts a step as (4 x 1), (2 x 2), (1 x 4) micro-batch x accumulation, with rollouts that
    depend on the prompt only: the step's rollouts, its completion-token total (dapo) and so the
    loss and the update are the same. Adam's eps=1 makes its update ~ lr x gradient (its first
    step is otherwise ~ lr x sign, blind to how the loss is normalised). The completion metrics and
    num_tokens are TRL's values of the (known) completions, some stopped and some cut."""
    from rolemrc.modules.grpo import GRPOModule

    sampled: list[tuple[int, torch.Tensor, list[int]]] = []

    def recorded(self: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sample: bool = True) -> torch.Tensor:
        new_ids = fixed_generate(self, prompt_ids, prompt_mask, sample)
        sampled.append((int(prompt_mask.sum()), new_ids, self.stop_ids))
        return new_ids

    monkeypatch.setattr(GRPOModule, "generate", recorded)
    results = {}
    for b, a in [(4, 1), (2, 2), (1, 4)]:
        cfg = train_cfg(*GRPO, *loss, f"data.batch_size={b}", f"trainer.accumulate_grad_batches={a}",
                        "trainer.max_steps=2", "optim.eps=1.0", "optim.lr=1.0", "trainer.gradient_clip_val=null")
        cfg.run_dir = str(tmp_path / f"{b}x{a}")
        sampled.clear()
        out = run(cfg)
        run_dir = Path(out["run_dir"])
        assert len(sampled) == 2  # one generation per step, all of its prompts at once
        check_completion_metrics(run_dir, sampled)
        state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
        results[(b, a)] = (state, series(run_dir, "train/loss"), series(run_dir, "train/completions/mean_length"),
                           series(run_dir, "train/reward"))
    state0, loss0, length0, reward0 = results[(4, 1)]
    start = {k: v.clone() for k, v in setup(train_cfg(*GRPO)).module.state_dict().items()}  # seeded as the runs
    assert len(loss0) == 2 and any(v != 0 for v in loss0)
    for key, (state, losses, lengths, rewards) in results.items():
        assert lengths == length0 and rewards == pytest.approx(reward0, abs=1e-7), key  # the same rollouts
        assert losses == pytest.approx(loss0, rel=1e-5, abs=1e-8), key
        for name, w in state.items():
            moved = (state0[name] - start[name]).norm().item()
            if moved == 0:
                continue
            assert (w - state0[name]).norm().item() <= 1e-3 * moved, f"{key}: {name}"
    assert sum((state0[k] - start[k]).norm().item() > 0 for k in state0) > 3  # the steps trained


def check_completion_metrics(run_dir: Path, sampled: list[tuple[int, torch.Tensor, list[int]]]) -> None:
    """TRL 1.16's completion metrics and num_tokens of each step's completions, by hand: a
    completion's length counts up to and including its first stop token (else all its tokens: cut),
    the terminated lengths are those of the stopped ones (0 when none), num_tokens adds every
    completion's prompt and completion tokens up over the run."""
    rows = [r for r in metric_rows(run_dir) if "train/loss" in r]
    assert len(rows) == len(sampled)
    tokens, mixed = 0, False
    for row, (prompt_tokens, new_ids, stops) in zip(rows, sampled):
        lengths, ended = [], []
        for ids in new_ids.tolist():
            at = next((i for i, t in enumerate(ids) if t in stops), None)
            lengths.append(len(ids) if at is None else at + 1)
            ended += [] if at is None else [at + 1]
        tokens += prompt_tokens + sum(lengths)
        mixed |= 0 < len(ended) < len(lengths)
        expected = {"mean_length": sum(lengths) / len(lengths), "min_length": min(lengths),
                    "max_length": max(lengths), "clipped_ratio": 1 - len(ended) / len(lengths),
                    "mean_terminated_length": sum(ended or [0]) / max(len(ended), 1),
                    "min_terminated_length": min(ended or [0]), "max_terminated_length": max(ended or [0])}
        for name, value in expected.items():
            assert row[f"train/completions/{name}"] == pytest.approx(value), name
        assert row["train/num_tokens"] == tokens
    assert mixed  # stopped and cut completions in one step: the terminated lengths are not the lengths


def constant_reward(*, prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    return [0.45] * len(completions)  # float32 sums of 0.45s leave a std of ~3e-8


def test_identical_completions_teach_nothing_and_are_counted(train_cfg) -> None:
    parts = setup(train_cfg(*GRPO, "data.batch_size=3",
                            "objective.rewards.vowels._target_=tests.train.test_grpo.constant_reward"))
    module, dm = parts.module, parts.datamodule
    module._chat = parts.chat
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    row = torch.tensor([[300, 301, 302, 303, 304, 305]])
    new_ids = torch.cat([row + 7 * k for k in range(3) for _ in range(3)])  # each prompt's 3 completions alike
    module.score(batch, new_ids)
    assert bool(batch["rollout_stats"]["is_std_zero"].all())  # frac_reward_zero_std = 1: exactly, in float64
    assert torch.equal(batch["advantages"], torch.zeros(9))


def test_config_errors_name_the_key_before_anything_loads(train_cfg) -> None:
    from rolemrc.config import check_train_config
    from rolemrc.errors import ConfigError

    for overrides, message in ((["objective=grpo", "data.prompts=[]"], "data.prompts, which data=sample leaves empty"),
                               ([*GRPO, "data.packing=true"], "set data.packing=false"),
                               ([*GRPO, "objective.num_iterations=0"], "objective.num_iterations must be >= 1"),
                               ([*GRPO, "objective.rollout=vllm"], "needs objective.vllm.base_url"),
                               ([*GRPO, "objective.num_generations=1"], "objective.num_generations must be >= 2"),
                               ([*GRPO, "objective.loss_type=ppo"], "objective.loss_type must be one of"),
                               ([*GRPO, "objective.importance_sampling_level=batch"],
                                "objective.importance_sampling_level must be one of"),
                               ([*GRPO, "objective.top_entropy_quantile=1.5"], "objective.top_entropy_quantile must be in"),
                               ([*GRPO, "objective.off_policy_mask_threshold=0"],
                                "objective.off_policy_mask_threshold must be > 0"),
                               ([*GRPO, "objective.sapo_temperature_neg=0"], "objective.sapo_temperature_neg must be > 0"),
                               ([*GRPO, "objective.multi_objective_aggregation=sum"],
                                "objective.multi_objective_aggregation must be one of"),
                               ([*GRPO, "objective.scale_rewards=rank"], "objective.scale_rewards must be one of"),
                               ([*GRPO, "objective.beta=0.1", "objective.reference=adapter"],
                                "objective.reference=adapter needs a LoRA model")):
        with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("[", r"\[")):
            check_train_config(train_cfg(*overrides))


def test_the_default_data_has_prompts(train_cfg) -> None:
    """Issue 33's command, ``train.py objective=grpo model.path=<SFT export>``, runs on data=sample:
    its prompts are the shipped rule-bearing ones (data=sample_rl's), with their rules for the verifier."""
    from rolemrc.config import check_train_config

    cfg = train_cfg("objective=grpo", "data.batch_size=2", "objective.num_generations=2")
    check_train_config(cfg)
    assert [Path(s.path).name for s in cfg.data.prompts] == ["rl.jsonl"]
    dm = setup(cfg).datamodule
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert len(batch["prompts"]) == 2 and any(r is not None for r in batch["columns"]["rule"])


def test_beta_zero_builds_no_reference_beta_positive_builds_one(train_cfg) -> None:
    assert setup(train_cfg(*GRPO)).module.reference is None
    module = setup(train_cfg(*GRPO, "objective.beta=0.1")).module
    assert module.reference is not None and module.reference.mode == "copy" and module.ref_model is not None
    assert module.ref_model is not module.model


TRL_NAMES = ["reward", "reward_std", "rewards/vowels/mean", "rewards/vowels/std", "rewards/verifier/mean",
             "frac_reward_zero_std", "num_tokens", "entropy", "completions/mean_length", "completions/min_length",
             "completions/max_length", "completions/clipped_ratio", "completions/mean_terminated_length",
             "completions/min_terminated_length", "completions/max_terminated_length", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
             "clip_ratio/low_min", "clip_ratio/high_max", "kl", "completion_tokens_per_s", "loss"]


CLIP_NAMES = [n for n in TRL_NAMES if n.startswith("clip_ratio/")]


@pytest.mark.parametrize("extra,names", [
    ([], TRL_NAMES),
    (["objective.loss_type=cispo", "objective.epsilon_high=5.0", "objective.importance_sampling_level=sequence",
      "objective.top_entropy_quantile=0.2", "objective.off_policy_mask_threshold=0.5"],
     [n for n in TRL_NAMES if n not in CLIP_NAMES] + ["cispo_clip_ratio"])])
def test_a_short_run_logs_trl_metric_names(train_cfg, monkeypatch, extra: list[str], names: list[str]) -> None:
    """TRL's names per step; validation samples as training samples (``num_generations`` completions
    per prompt at the training temperature, not one greedy reply, whose short degenerate answers met
    the sample's "at most n words" / "no letter y" rules: val/reward 1.0 beside a train/reward of 0.1),
    and its val/reward is the mean reward of those completions, which the run summary names."""
    from rolemrc.modules.grpo import GRPOModule
    from rolemrc.rewards import RewardSet

    phase, calls = {"now": None}, []
    generate, score = GRPOModule.generate, RewardSet.__call__

    def spy_generate(self, prompt_ids, prompt_mask, sample=True):
        phase["now"] = "val" if self.trainer.validating and not self.trainer.sanity_checking else "train"
        calls.append({"phase": phase["now"], "sample": sample, "rows": prompt_ids.shape[0], "rewards": None})
        return generate(self, prompt_ids, prompt_mask, sample)

    def spy_score(self, prompts, completions, columns=None):
        out = score(self, prompts, completions, columns)
        calls[-1]["rewards"] = out.rewards.tolist()
        return out

    monkeypatch.setattr(GRPOModule, "generate", spy_generate)
    monkeypatch.setattr(RewardSet, "__call__", spy_score)
    out = run(train_cfg(*GRPO, "trainer.max_steps=3", "objective.beta=0.05", "data.val_fraction=0.1", *extra))
    run_dir = Path(out["run_dir"])
    val = [c for c in calls if c["phase"] == "val"]
    n_val = int(out["summary"]["notes"]["val/reward"].split()[0])  # "<prompts> validation prompts x 3 ..."
    assert val and all(c["sample"] for c in calls)  # sampled, as in training
    assert sum(c["rows"] for c in val) == n_val * 3  # num_generations completions per validation prompt
    want = torch.tensor([r for c in val for r in c["rewards"]], dtype=torch.float64).nanmean().item()
    assert series(run_dir, "val/reward")[-1] == pytest.approx(want, abs=1e-6)
    assert out["summary"]["val_metrics"]["val/completions/mean_length"] <= 6
    assert f"{n_val} validation prompts x 3 completions sampled as in training" in out["summary"]["notes"]["val/reward"]
    assert out["summary"]["train_reward"] == pytest.approx(series(run_dir, "train/reward")[-1])
    rows = [r for r in metric_rows(run_dir) if "train/loss" in r]
    assert len(rows) == 3
    for name in names:
        assert all(f"train/{name}" in r for r in rows), name
    loss_metrics = {k for r in rows for k in r if k.startswith(("train/clip_ratio/", "train/cispo"))}
    assert loss_metrics == {f"train/{n}" for n in names if n.startswith(("clip_ratio/", "cispo"))}
    assert all(0 <= r["train/rewards/vowels/mean"] <= 1 for r in rows)
    assert all(r["train/completions/max_length"] <= 6 for r in rows)
    assert any(r["train/reward_std"] > 0 for r in rows)
    assert series(run_dir, "val/reward") and series(run_dir, "val/rewards/vowels/mean")
    assert (run_dir / "checkpoints" / "last.ckpt").exists()


class CrashAt(L.Callback):
    """Stops the process's training with an exception at the start of step ``step`` (a crash)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"crash at step {self.step}")


def test_crash_and_resume_gives_the_uninterrupted_rollouts(tmp_path: Path) -> None:
    from tests.conftest import FAST, compose_train

    common = [*FAST, *GRPO, "trainer.max_steps=5", "runtime.checkpoint_every_n_steps=2"]
    reference = run(compose_train(common, run_dir=tmp_path / "reference"))
    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="crash at step 3"):
        run(compose_train([*common, "+callbacks.crash._target_=tests.train.test_grpo.CrashAt",
                           "+callbacks.crash.step=3"], run_dir=crashed))
    assert torch.load(crashed / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2
    run(compose_train([*common, "ckpt_path=last"], run_dir=crashed))
    for key in ("train/loss", "train/reward", "train/rewards/vowels/mean", "train/completions/mean_length"):
        want, got = series(Path(reference["run_dir"]), key), series(crashed, key)
        assert len(want) == 5 and got == pytest.approx(want, abs=1e-6, nan_ok=True), key
    assert len(set(series(crashed, "train/reward"))) > 1  # rollouts differ from step to step


def test_memory_simulation_runs_the_rollout_and_the_loss_step() -> None:
    """Both phases of a step (the rollout's generate, then the loss step on rollout shapes) under
    the tracker; the report's peak is the larger, named. The loss step holds the step's other
    rollouts, and with num_iterations > 1 their old log-probs: more than one micro-batch alone."""
    from tests.test_memory_sim import simulate
    from tests.conftest import compose_train

    sim = simulate(compose_train(GRPO), checkpointing=False)
    assert sim.rows == 2 * 3 and sim.tokens == 2 * 3 * (48 + 6)  # prompts x generations, prompt + completion
    assert sim.rollout["sequences"] == 2 * 3 and sim.rollout["completion_tokens"] == 6  # accumulate 1
    assert sim.peak_bytes == max(p["peak_bytes"] for p in sim.phases.values()) > 0
    assert "rollout" in sim.note and "not simulated" in sim.note
    # the step's prompts are sampled at once: 4 micro-batches' worth of sequences in one generate
    more = simulate(compose_train([*GRPO, "trainer.accumulate_grad_batches=4", "objective.num_iterations=2"]),
                    checkpointing=False)
    assert more.rollout["sequences"] == 4 * 2 * 3
    assert more.rollout["kv_cache_bytes"] == 4 * sim.rollout["kv_cache_bytes"]
    assert more.phases["rollout"]["peak_bytes"] > sim.phases["rollout"]["peak_bytes"]
    assert more.phases["step"]["peak_bytes"] > sim.phases["step"]["peak_bytes"]  # the rollouts and old log-probs kept


def test_memory_formula_counts_rollout_tokens_and_a_reference_only_when_beta_is_positive() -> None:
    from tests.conftest import compose_train
    from tests.test_memory import check

    assert f"{2 * 3 * (48 + 6)} tokens/micro-batch" in check(compose_train(GRPO))
    big = ["model.init.hidden_size=1024", "model.init.intermediate_size=4096", "model.init.num_hidden_layers=8"]
    without, with_ref = (float(check(compose_train([*GRPO, *big, f"objective.beta={b}"])).split()[0].lstrip("~"))
                         for b in (0.0, 0.1))
    assert with_ref > without


def test_memory_formula_counts_the_rollout_and_auto_decides_from_the_step() -> None:
    """The formula's GRPO estimate is the larger of the loss step and the rollout (generate of the
    step's completions at once: KV cache, prefill); a rollout too large for the device is said, but
    does not turn activation checkpointing on (it keeps no activations)."""
    from rolemrc.sizing.formula import arch_of, rollout_gb
    from tests.test_memory import check, choose_checkpointing
    from tests.conftest import compose_train

    cfg = compose_train([*GRPO, "trainer.accumulate_grad_batches=64", "objective.max_completion_length=4096",
                         "model.gradient_checkpointing=auto", "runtime.device_memory_gb=0.5"])
    arch = arch_of(cfg.model)
    gb = rollout_gb(arch, gpus=1, fsdp=False, sequences=2 * 64 * 3, prompt=48, completion=4096)
    line = check(cfg)
    assert "set by the rollout" in line and line.startswith(f"WARNING: ~{gb:.1f} GB")
    on, why = choose_checkpointing(cfg)
    assert on is False and "the rollout" in why and "does not lower it" in why
    # objective.rollout=vllm: no generate on the trainer's memory as simulated; the loss step alone
    from rolemrc.config import typed
    from rolemrc.modules.grpo import GRPOModule

    vllm = compose_train([*GRPO, "trainer.accumulate_grad_batches=64", "objective.max_completion_length=4096",
                          "runtime.device_memory_gb=0.5", "objective.rollout=vllm",
                          "objective.vllm.base_url=http://127.0.0.1:9/v1"])
    assert GRPOModule.memory_rollout(vllm, 2) is None and typed(vllm.objective).rollout_shape(vllm.data, vllm.trainer) is None
    assert "set by the rollout" not in check(vllm)
    assert GRPOModule.memory_rollout(cfg, 2)["sequences"] == 2 * 64 * 3
    # the KV cache term: per layer a bf16 key and value of kv_heads x head_dim per position
    kv = arch.layers * 2 * arch.kv_heads * (arch.h // arch.heads) * 2
    assert rollout_gb(arch, gpus=1, fsdp=False, sequences=10, prompt=48, completion=101) - \
        rollout_gb(arch, gpus=1, fsdp=False, sequences=10, prompt=48, completion=100) == pytest.approx(10 * kv / 1024**3)


def test_num_iterations_reuses_each_steps_rollouts_and_resumes_mid_reuse(tmp_path: Path, monkeypatch) -> None:
    """num_iterations=2: rollouts sampled at steps 1 and 3 only, trained again at steps 2 and 4
    with the old log-probs of their first use (ratio != 1 once the policy moved: clipped tokens);
    a crash after step 3 resumes on the kept rollouts and gives the uninterrupted run."""
    from rolemrc.modules.grpo import GRPOModule
    from tests.conftest import FAST, compose_train

    calls: list[int] = []
    real = GRPOModule.generate

    def counted(self: Any, prompt_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(self.trainer.global_step)
        return real(self, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(GRPOModule, "generate", counted)
    common = [*FAST, *GRPO, "objective.num_iterations=2", "trainer.max_steps=4", "runtime.checkpoint_every_n_steps=1",
              "optim.lr=3e-2", "objective.epsilon=0.05", "trainer.accumulate_grad_batches=2", "data.batch_size=1"]
    reference = Path(run(compose_train(common, run_dir=tmp_path / "reference"))["run_dir"])
    assert calls == [0, 2]  # one generation per two optimizer steps
    rows = [r for r in metric_rows(reference) if "train/loss" in r]
    assert len(rows) == 4
    rewards = [r["train/reward"] for r in rows]  # a reuse step shows its rollouts' (Lightning keeps the last value)
    assert rewards[0] == rewards[1] and rewards[2] == rewards[3] and rewards[0] != rewards[2]
    assert all(r["train/clip_ratio/region_mean"] == 0 for r in rows[::2])  # first use: ratio 1
    assert any(r["train/clip_ratio/region_mean"] > 0 for r in rows[1::2])  # reuse after an update: clipped

    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="crash at step 3"):
        run(compose_train([*common, "+callbacks.crash._target_=tests.train.test_grpo.CrashAt",
                           "+callbacks.crash.step=3"], run_dir=crashed))
    saved = torch.load(crashed / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 3 and saved["per_rank_state"][0]["grpo_rollouts"]["uses"] == 1
    calls.clear()
    run(compose_train([*common, "ckpt_path=last"], run_dir=crashed))
    assert calls == []  # step 4 trains on the kept rollouts
    for key in ("train/loss", "train/clip_ratio/region_mean", "train/clip_ratio/low_mean", "train/reward"):
        want, got = series(reference, key), series(crashed, key)
        assert got == pytest.approx(want, abs=1e-6, nan_ok=True), key


def test_rollout_and_loss_metrics_over_ranks_are_trls_global_values() -> None:
    """Two ranks' rollout statistics: the disagreement rate is the share over every completion both
    rewards scored (1 of 4 here), not the mean of the ranks' shares (1/2); the loss metrics are each
    micro-batch's token-weighted value over the ranks, then their mean over the micro-batches."""
    from rolemrc.modules.grpo import GRPOModule
    from rolemrc.modules.scoring import rollout_metrics, sampling_metrics

    nan = float("nan")

    def rank(judge: list[float], rules: list[float], lengths: list[int], truncated: list[bool]) -> dict[str, Any]:
        per = torch.tensor([judge, rules], dtype=torch.float64).T
        rate = sum((j >= 0.5) != (r >= 1) for j, r in zip(judge, rules) if j == j and r == r)
        both = sum(j == j and r == r for j, r in zip(judge, rules))
        return {"names": ["judge", "rules"], "per_reward": per, "rewards": per.nansum(1),
                "is_std_zero": torch.zeros(len(judge), dtype=torch.bool), "lengths": torch.tensor(lengths),
                "truncated": torch.tensor(truncated), "seconds": 1.0, "prompt_tokens": 10,
                "extra": {"rewards/disagreement/judge_vs_rules": rate / both, "rewards/judge/missing": 1.0}}

    stats = [rank([1.0, 0.0], [0.0, nan], [3, 6], [False, True]),  # 1 scored by both: disagree
             rank([1.0, 0.0, 1.0], [1.0, 0.0, 1.0], [6, 6, 6], [True, True, True])]  # 3: agree
    m = rollout_metrics(stats)
    assert m["rewards/disagreement/judge_vs_rules"] == pytest.approx(1 / 4)
    assert m["rewards/judge/missing"] == 2.0
    assert m["completions/clipped_ratio"] == pytest.approx(4 / 5)
    assert (m["completions/mean_terminated_length"], m["completions/max_terminated_length"]) == (3.0, 3.0)
    assert m["completions/mean_length"] == pytest.approx(27 / 5)

    def micro(tokens: float, mean: float, low_min: float) -> dict[str, Any]:
        return {"tokens": tokens, "metrics": {"entropy": mean, "clip_ratio/low_min": low_min}}

    out = GRPOModule._loss_metrics([[micro(1, 1.0, 0.5), micro(3, 2.0, nan)],
                                    [micro(3, 3.0, 0.25), micro(1, 6.0, nan)]])
    assert out["entropy"] == pytest.approx(((1 + 9) / 4 + (6 + 6) / 4) / 2)
    assert out["clip_ratio/low_min"] == 0.25  # NaN micro-batches are skipped, as TRL's log skips them
    # a per-sequence mean (GSPO's sequence-level ratios): weighted by each rank's sequences, not tokens
    seq = [[{"tokens": 10.0, "weights": {"clip_ratio/high_mean": 1.0}, "metrics": {"clip_ratio/high_mean": 1.0}}],
           [{"tokens": 1.0, "weights": {"clip_ratio/high_mean": 3.0}, "metrics": {"clip_ratio/high_mean": 0.0}}]]
    assert GRPOModule._loss_metrics(seq)["clip_ratio/high_mean"] == pytest.approx(1 / 4)
    # TRL's policy_loss: a plain mean over ranks (gather().nanmean()), then over the micro-batches
    pol = [[{"tokens": 10.0, "weights": {"policy_loss": 1.0}, "metrics": {"policy_loss": 1.0}},
            {"tokens": 1.0, "weights": {"policy_loss": 1.0}, "metrics": {"policy_loss": 3.0}}],
           [{"tokens": 1.0, "weights": {"policy_loss": 1.0}, "metrics": {"policy_loss": 2.0}},
            {"tokens": 5.0, "weights": {"policy_loss": 1.0}, "metrics": {"policy_loss": 0.0}}]]
    assert GRPOModule._loss_metrics(pol)["policy_loss"] == pytest.approx((1.5 + 1.5) / 2)
    # vLLM's correction: each rank's values over its rollouts (micro-batches pooled), then the ranks' mean
    # and extremes (TRL: a rank's generation batch, gathered)
    def sampled(d_sum: float, d_n: float, d_max: float, r_sum: float, r_n: float, r_min: float, r_max: float):
        return {"sampling": {"delta_sum": d_sum, "delta_count": d_n, "delta_max": d_max, "ratio_sum": r_sum,
                             "ratio_count": r_n, "ratio_min": r_min, "ratio_max": r_max}}

    got = sampling_metrics([[sampled(1.0, 2, 0.8, 2.0, 2, 0.5, 1.5), sampled(2.0, 2, 1.2, 4.0, 2, 1.0, 3.0)],
                            [sampled(3.0, 1, 3.0, 0.0, 1, 0.0, 0.0)]])
    assert got == pytest.approx({"sampling/sampling_logp_difference/mean": (3 / 4 + 3 / 1) / 2,
                                 "sampling/sampling_logp_difference/max": 3.0,
                                 "sampling/importance_sampling_ratio/min": 0.0,
                                 "sampling/importance_sampling_ratio/mean": (6 / 4 + 0) / 2,
                                 "sampling/importance_sampling_ratio/max": 3.0})


def test_adaptive_control_pools_the_steps_entropy_over_micro_batches_and_ranks(train_cfg) -> None:
    """Skywork-OR1's update takes the step's token-weighted entropy over every micro-batch and rank
    (TRL reduces the window's sum and token count), not a mean of means."""
    parts = setup(train_cfg(*GRPO, "objective.entropy_coef=0.1", "objective.use_adaptive_entropy=true",
                            "objective.entropy_target=2.0", "objective.entropy_coef_delta=0.05"))
    module = parts.module
    per_rank = [[{"entropy_window": (1.0, 1.0)}, {"entropy_window": (30.0, 10.0)}],  # 3 nats over 10 tokens
                [{"entropy_window": (0.0, 9.0)}]]  # (1 + 30 + 0) / 20 = 1.55 <= 2: up
    assert module.entropy_control.update(per_rank) == pytest.approx(0.15)
    assert module.entropy_control.last_entropy == pytest.approx(1.55)  # not the micro-batches' mean of means (4/3)
    per_rank = [[{"entropy_window": (50.0, 10.0)}], [{"entropy_window": (0.0, 10.0)}]]  # 2.5 > 2: down
    assert module.entropy_control.update(per_rank) == pytest.approx(0.10)
    assert module.entropy_control.state_dict()["grpo_entropy_control"] == {"entropy_coef": pytest.approx(0.10),
                                                                           "last_entropy": 2.5}


def test_a_broken_reward_stops_train_py_with_one_line(tmp_path: Path) -> None:
    """Through the entry script: a reward returning +inf (which trained on with ``train/reward inf``
    and exit 0) stops the run at its first rollout with one ``error:`` line naming the reward and
    what it returned, exit 1, no traceback, no export and no run summary."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "objective=grpo", "data=sample_rl", "data.batch_size=2",
         "objective.num_generations=2", "objective.max_completion_length=4", "trainer.max_steps=2", "logger=csv",
         "trainer.enable_progress_bar=false", "+objective.rewards.bad._target_=tests.rewards.helpers.bad_reward",
         "+objective.rewards.bad.returns=infinite", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled"}, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert errors == ["error: reward 'bad' (tests.rewards.helpers.bad_reward) returned inf for completion 0 of 4: a "
                      "reward must be finite (None or NaN: does not apply to that completion)"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "export").exists() and not (run_dir / "run_summary.json").exists()


def test_entropy_quantile_pools_every_ranks_completion_tokens() -> None:
    """top_entropy_quantile on two ranks: the threshold is the quantile over both ranks' completion
    tokens (3 here, 5 there; padding and prompt positions left out), as TRL gathers them."""
    from types import SimpleNamespace

    from rolemrc.modules.grpo import GRPOModule
    from rolemrc.objectives.grpo import high_entropy_mask

    entropy = torch.tensor([[0.1, 0.2, 9.0], [0.3, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    other = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])  # the other rank's completion-token entropies

    def all_gather(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.long:  # the sizes
            return torch.stack([x, torch.tensor([other.numel()])])
        theirs = torch.full_like(x, float("nan"))
        theirs[:other.numel()] = other
        return torch.stack([x, theirs])

    me = SimpleNamespace(_trainer=object(), trainer=SimpleNamespace(world_size=2), all_gather=all_gather)
    pooled = GRPOModule._pooled_entropies(me, entropy, mask)
    assert sorted(v for v in pooled.tolist() if v == v) == pytest.approx([0.1, 0.2, 0.3, 1, 2, 3, 4, 5])
    kept = high_entropy_mask(entropy, mask.long(), 0.5, pooled=pooled)  # median of the 8: 1.5 -> none here
    assert not kept.any()
    assert high_entropy_mask(entropy, mask.long(), 1.0, pooled=pooled).sum() == 3


def test_adaptive_entropy_bonus_logs_trl_names_and_resumes_exactly(tmp_path: Path) -> None:
    """``use_adaptive_entropy``: no bonus at step 1 (no entropy measured yet), then the coefficient moves
    by ``entropy_coef_delta`` after each step by the step's entropy against the target (one micro-batch
    per step: the logged ``entropy``), within its bounds; TRL's ``entropy_coef`` and ``policy_loss`` are
    logged; the coefficient and the last entropy are in the checkpoint, so a crash resumes exactly."""
    from tests.conftest import FAST, compose_train

    common = [*FAST, *GRPO, "trainer.max_steps=4", "runtime.checkpoint_every_n_steps=1", "optim.lr=3e-2",
              "objective.entropy_coef=0.1", "objective.use_adaptive_entropy=true", "objective.entropy_target=100",
              "objective.entropy_coef_delta=0.05", "objective.entropy_coef_max=0.22"]
    reference = Path(run(compose_train(common, run_dir=tmp_path / "reference"))["run_dir"])
    rows = [r for r in metric_rows(reference) if "train/loss" in r]
    assert len(rows) == 4
    coef = 0.1
    for r in rows:  # the target is above any entropy here: up by delta each step, capped at the maximum
        coef = min(coef + 0.05, 0.22) if r["train/entropy"] <= 100 else max(coef - 0.05, 0.0)
        assert r["train/entropy_coef"] == pytest.approx(coef)
    assert rows[0]["train/loss"] == pytest.approx(rows[0]["train/policy_loss"], abs=1e-6)  # step 1: no bonus
    assert rows[1]["train/loss"] == pytest.approx(  # step 2: the bonus, 0.15 x the entropy
        rows[1]["train/policy_loss"] - 0.15 * rows[1]["train/entropy"], abs=1e-5)

    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="crash at step 2"):
        run(compose_train([*common, "+callbacks.crash._target_=tests.train.test_grpo.CrashAt",
                           "+callbacks.crash.step=2"], run_dir=crashed))
    saved = torch.load(crashed / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["grpo_entropy_control"]["entropy_coef"] == pytest.approx(0.2)
    run(compose_train([*common, "ckpt_path=last"], run_dir=crashed))
    for key in ("train/loss", "train/entropy_coef", "train/policy_loss", "train/entropy"):
        assert series(crashed, key) == pytest.approx(series(reference, key), abs=1e-6), key
