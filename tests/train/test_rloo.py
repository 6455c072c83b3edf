"""objective=rloo end to end: the step's loss, gradient and metrics against TRL 1.16's own
``RLOOTrainer._compute_loss`` on the same rollouts (the advantages and KL by TRL's lines,
tests/objectives/test_rloo_trl.py), with beta > 0 and on a reuse step; a short run's TRL metric
names; a crash mid-reuse resumed to the uninterrupted run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rolemrc.run.train import run, setup
from tests.train.helpers import metric_rows, series
from tests.train.test_grpo import GRPO, TRL_NAMES, by_hand_entropy, vowel_reward

pytestmark = pytest.mark.xdist_group("grpo")

RLOO = [a.replace("objective=grpo", "objective=rloo") for a in GRPO]


def by_hand(module: Any, batch: dict, new_ids: torch.Tensor) -> dict[str, Any]:
    """Fixed completions' per-token log-probs (policy with gradient; reference), mask and summed
    rewards (vowels + the verifier, NaN where neither applies), from the model's plain logits."""
    o, g = module.objective, module.objective.num_generations
    is_stop = torch.isin(new_ids, torch.tensor(module.stop_ids))
    mask = torch.zeros_like(new_ids)
    for i, row in enumerate(is_stop):
        mask[i, :int(row.int().argmax()) + 1 if bool(row.any()) else new_ids.shape[1]] = 1
    texts = module.chat.tokenizer.batch_decode([r[m.bool()].tolist() for r, m in zip(new_ids, mask)],
                                               skip_special_tokens=True)
    prompts = [p for p in batch["prompts"] for _ in range(g)]
    from rolemrc.rewards import VerifierReward

    ver = VerifierReward("all")(prompts=prompts, completions=texts, rule=[r for r in batch["columns"]["rule"]
                                                                          for _ in range(g)])
    per = torch.stack([torch.tensor(vowel_reward(prompts=prompts, completions=texts), dtype=torch.float64),
                       torch.tensor([float("nan") if v is None else v for v in ver], dtype=torch.float64)], 1)
    p = batch["prompt_ids"].shape[1]
    ids = torch.cat([batch["prompt_ids"].repeat_interleave(g, 0), new_ids], 1)
    attention = torch.cat([batch["prompt_mask"].repeat_interleave(g, 0), mask], 1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)

    def logps_of(model: Any) -> torch.Tensor:
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits.float()
        return torch.log_softmax(logits[:, p - 1:-1] / o.temperature, -1).gather(-1, new_ids.unsqueeze(-1)).squeeze(-1)

    ref = None
    if o.beta > 0:
        with torch.no_grad():
            ref = logps_of(module.ref_model)
    from trl.trainer.utils import entropy_from_logits  # noqa: F401  (TRL present: the comparison runs)

    return {"logps": logps_of(module.model), "ref": ref, "mask": mask, "rewards": per.nansum(1)}


@pytest.mark.parametrize("extra", [["objective.beta=0"],
                                   ["objective.beta=0.05", "objective.temperature=0.7", "objective.num_iterations=2",
                                    "objective.epsilon=0.05", "objective.num_generations=3"]])
def test_step_loss_equals_trls_loss_of_the_rollouts(train_cfg, monkeypatch, extra: list[str]) -> None:
    """Our step against TRL's ``_compute_loss`` on the same rollouts, TRL's advantages from the same
    rewards (and, beta > 0, the KL of the policy that sampled them); with num_iterations=2 also the
    reuse step, after the policy moved, with the rollout's sequence log-probs as the old ones."""
    from rolemrc.modules.scoring import rollout_metrics
    from tests.objectives.test_rloo_trl import trl_rloo_advantages, trl_rloo_loss

    parts = setup(train_cfg(*RLOO, *extra))
    module, dm = parts.module, parts.datamodule
    module._chat = parts.chat
    o = module.objective
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    fresh = dict(batch)
    n = batch["prompt_ids"].shape[0] * o.num_generations
    gen = torch.Generator().manual_seed(0)
    new_ids = torch.randint(10, module.chat.tokenizer.vocab_size, (n, 6), generator=gen)
    new_ids[0, 2] = module.stop_ids[0]
    new_ids[4, 0] = module.stop_ids[0]
    monkeypatch.setattr(module, "generate", lambda *a, **k: new_ids.clone())

    def move(scale: float) -> None:
        with torch.no_grad():
            for p in module.model.parameters():
                p.add_(scale * torch.randn(p.shape, generator=gen))

    if o.beta > 0:
        move(0.02)  # off the reference: the KL has a value
    params = [p for p in module.model.parameters() if p.requires_grad]
    loss, _ = module.step_loss(batch)
    inputs = by_hand(module, batch, new_ids)
    mask, old_tokens = inputs["mask"], inputs["logps"].detach()
    old = (old_tokens * mask).sum(-1)
    kl = ((old_tokens - inputs["ref"]) * mask).sum(-1).double() if o.beta > 0 else None
    adv, zero = trl_rloo_advantages(inputs["rewards"], o.num_generations, kl, o.beta)
    torch.testing.assert_close(batch["advantages"], adv.float(), rtol=1e-5, atol=1e-6)
    assert batch["advantages"].abs().sum() > 0
    stats = batch["rollout_stats"]
    assert stats["is_std_zero"].view(-1, o.num_generations)[:, 0].tolist() == zero.tolist()
    if o.beta > 0:  # TRL's kl: the token mean of old - ref over the generation batch
        want = float(((old_tokens - inputs["ref"]) * mask).sum() / mask.sum())
        assert stats["kl_sum"] / stats["kl_tokens"] == pytest.approx(want, rel=1e-4, abs=1e-7) and want != 0
        assert rollout_metrics([stats])["kl"] == pytest.approx(want, rel=1e-4, abs=1e-7)

    def compare(loss: torch.Tensor, inputs: dict[str, Any]) -> None:
        expected, logged = trl_rloo_loss(inputs["logps"], adv.float(), mask, old.float(), entropies=None,
                                         epsilon=o.epsilon, epsilon_high=o.epsilon_high)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        want_grads = torch.autograd.grad(expected, params, allow_unused=True)
        assert loss.item() == pytest.approx(expected.item(), rel=1e-4, abs=1e-6)
        assert sum(g.abs().sum() for g in grads if g is not None) > 0
        for g, e in zip(grads, want_grads):
            assert (g is None) == (e is None)
            if g is not None:
                torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-6)
        ours = module._loss_stats[-1]["metrics"]
        assert set(ours) == set(logged)
        for name in set(logged) - {"entropy"}:  # the stand-in's entropy is 0: ours by hand below
            assert ours[name] == pytest.approx(logged[name], rel=1e-5, abs=1e-7), name
        assert ours["entropy"] == pytest.approx(by_hand_entropy(module, batch, new_ids), rel=1e-5)

    compare(loss, inputs)
    if o.num_iterations == 1:
        return
    move(0.05)
    reused = {**fresh, "step_use": 1}
    loss, _ = module.step_loss(reused)
    assert torch.equal(reused["input_ids"], batch["input_ids"])
    compare(loss, by_hand(module, reused, new_ids))
    assert module._loss_stats[-1]["metrics"]["clip_ratio/region_mean"] > 0  # off-policy: clipped sequences


def test_a_short_run_logs_trl_names_and_resumes_mid_reuse(tmp_path: Path, monkeypatch) -> None:
    """num_iterations=2, beta > 0: rollouts sampled at steps 1 and 3 only; TRL's metric names on
    every step; a crash after step 3 resumes on the kept rollouts (their old log-probs included)
    and gives the uninterrupted run."""
    from rolemrc.modules.rloo import RLOOModule
    from tests.conftest import FAST, compose_train
    from tests.train.test_grpo import CrashAt  # noqa: F401  (named by the callback's _target_)

    calls: list[int] = []
    real = RLOOModule.generate

    def counted(self: Any, prompt_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(self.trainer.global_step)
        return real(self, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(RLOOModule, "generate", counted)
    common = [*FAST, *RLOO, "objective.num_iterations=2", "trainer.max_steps=4", "runtime.checkpoint_every_n_steps=1",
              "optim.lr=3e-2", "objective.epsilon=0.05", "trainer.accumulate_grad_batches=2", "data.batch_size=1",
              "objective.num_generations=3"]
    reference = Path(run(compose_train(common, run_dir=tmp_path / "reference"))["run_dir"])
    assert calls == [0, 2]
    rows = [r for r in metric_rows(reference) if "train/loss" in r]
    assert len(rows) == 4
    for name in TRL_NAMES:
        assert all(f"train/{name}" in r for r in rows), name
    assert all(r["train/clip_ratio/region_mean"] == 0 for r in rows[::2])  # first use: ratio 1
    assert any(r["train/clip_ratio/region_mean"] > 0 for r in rows[1::2])
    assert rows[2]["train/kl"] != 0  # the policy moved off the reference

    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="crash at step 3"):
        run(compose_train([*common, "+callbacks.crash._target_=tests.train.test_grpo.CrashAt",
                           "+callbacks.crash.step=3"], run_dir=crashed))
    saved = torch.load(crashed / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["per_rank_state"][0]["grpo_rollouts"]["uses"] == 1
    assert "old_sequence_logps" in saved["per_rank_state"][0]["grpo_rollouts"]["parts"][0]
    calls.clear()
    run(compose_train([*common, "ckpt_path=last"], run_dir=crashed))
    assert calls == []
    for key in ("train/loss", "train/clip_ratio/region_mean", "train/reward", "train/kl"):
        want, got = series(reference, key), series(crashed, key)
        assert got == pytest.approx(want, abs=1e-6, nan_ok=True), key


def test_config_errors_name_the_key_and_the_memory_planner_runs(train_cfg) -> None:
    from rolemrc.config import check_train_config
    from tests.conftest import compose_train
    from tests.test_memory_sim import simulate

    for bad, key in ((["objective.num_generations=1"], "num_generations"),
                     (["objective.reward_clip_range=[1,0]"], "reward_clip_range"),
                     (["objective.loss_type=dapo"], "loss_type")):
        with pytest.raises(Exception, match=key):
            check_train_config(train_cfg(*RLOO, *bad))
    sim = simulate(compose_train([*RLOO, "objective.beta=0.05"]), checkpointing=False)
    assert sim.rows == 2 * 3 and sim.peak_bytes > 0 and "RLOO" in sim.note
