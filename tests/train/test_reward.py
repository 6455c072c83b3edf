"""Reward-model training (``objective=reward``): a one-score head on the policy's architecture,
trained on the sample pairs, exported as a model ``AutoModelForSequenceClassification`` loads,
which GRPO's ``reward_model`` reward then uses as it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rolemrc.config import check_train_config
from rolemrc.errors import ConfigError
from rolemrc.run.train import fit, setup
from tests.train.helpers import series

SMALL = ["objective=reward", "data.batch_size=2", "data.max_length=160", "data.max_prompt_length=96"]
SAMPLE = Path(__file__).resolve().parents[2] / "src/rolemrc/assets/sample/pairs.jsonl"


def test_a_reward_model_trains_exports_and_scores_grpo_completions(train_cfg) -> None:
    from transformers import AutoModelForSequenceClassification

    from rolemrc.rewards.combine import build_rewards

    run = setup(train_cfg(*SMALL, "trainer.max_steps=2"))
    assert type(run.module.model).__name__ == "LlamaForSequenceClassification"
    assert run.module.model.config.num_labels == 1
    seen: list[int] = []  # each micro-batch's tokens, padding not counted (TRL's attention_mask.sum())
    step_loss = run.module.step_loss
    run.module.step_loss = lambda batch: (seen.append(int(batch["attention_mask"].sum())), step_loss(batch))[1]
    fit(run)
    run_dir = Path(run.parts.run_dir)
    assert len(series(run_dir, "train/loss")) == 2
    # TRL's num_tokens: the tokens trained on so far, one micro-batch per step here; kept in the checkpoint
    assert len(seen) == 2 and series(run_dir, "train/num_tokens") == [seen[0], seen[0] + seen[1]]
    ckpts = sorted(run_dir.glob("checkpoints/*.ckpt"))
    assert ckpts and torch.load(ckpts[-1], map_location="cpu", weights_only=True)["reward_num_tokens"] == sum(seen)
    for name in ("train/accuracy", "train/margin", "train/mean_reward", "val/accuracy", "val/margin",
                 "val/min_reward", "val/max_reward", "val/loss"):  # TRL's RewardTrainer names
        assert series(run_dir, name), name
    assert 0.0 <= series(run_dir, "val/accuracy")[-1] <= 1.0

    export = run_dir / "export"
    loaded = AutoModelForSequenceClassification.from_pretrained(export).eval()
    assert loaded.config.num_labels == 1 and loaded.config.pad_token_id == run.chat.tokenizer.pad_token_id
    # the export scores the run's pairs as the trained module did (the same head, the same last token)
    batch = next(iter(run.datamodule.val_dataloader()))
    module = run.module.eval()
    with torch.no_grad():
        chosen, rejected = module.rewards(batch)
        theirs = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    assert torch.allclose(torch.cat([chosen, rejected]), theirs, atol=1e-5)

    # GRPO's reward_model reward loads the export as it is and scores a completion like the model
    rewards = build_rewards({"rm": {"type": "reward_model", "path": str(export), "device": "cpu"}})
    reward = rewards.rewards["rm"]
    prompt = [{"role": "user", "content": "Who are you?"}]
    scored = reward(prompts=[prompt, prompt], completions=["Colette, mon ami. Voila!", "No."])
    ids = run.chat.tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": "No."}], tokenize=True,
                                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        direct = loaded(input_ids=torch.tensor([ids])).logits.item()
    assert scored[1] == pytest.approx(direct, abs=1e-5) and scored[0] != scored[1]

    # evaluate.py model.path=<the export>: accuracy on the pairs the run held out, by RoleMRC task
    from rolemrc.config import Replier
    from rolemrc.rewards.evaluation import is_reward_model, run_reward_model
    from tests.eval.test_evaluate_run import compose_eval

    assert is_reward_model(export) and not is_reward_model(SAMPLE.parent)
    metrics = run_reward_model(Replier.of(compose_eval(f"model.path={export}", f"out_dir={run_dir / 'eval'}",
                                                       "generation.device=cpu")))
    val = run.datamodule.val_rows
    assert metrics["pairs"] == len(val) == 8
    assert metrics["accuracy"] == pytest.approx(series(run_dir, "val/accuracy")[-1])  # the run's own val pairs
    assert sum(s["pairs"] for s in metrics["by_task"].values()) == 8
    assert json.loads((run_dir / "eval" / "metrics.json").read_text())["accuracy"] == metrics["accuracy"]


def test_lora_keeps_the_score_head_trainable_and_exports_a_classifier(train_cfg, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    from rolemrc.models.export import export_pretrained

    run = setup(train_cfg(*SMALL, "model.peft.enabled=true", "trainer.max_steps=1"))
    trainable = {n for n, p in run.module.model.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in trainable)
    assert any(n.endswith("score.modules_to_save.default.weight") for n in trainable), sorted(trainable)
    assert not any("embed_tokens" in n or "mlp" in n for n in trainable)
    head = dict(run.module.model.named_parameters())
    trained = next(v for n, v in head.items() if n.endswith("score.modules_to_save.default.weight"))
    with torch.no_grad():
        trained.add_(1.0)  # as training would move it; the frozen original stays
    trained = trained.detach().clone()
    out = export_pretrained(run.module.model, run.chat.tokenizer, tmp_path / "export", merge_lora=True)
    loaded = AutoModelForSequenceClassification.from_pretrained(out)
    assert torch.equal(loaded.score.weight, trained)  # the trained head, not the frozen original


@pytest.mark.parametrize("cache", ["true", "false"])
def test_per_pair_margins_reach_the_loss(train_cfg, tmp_path: Path, cache: str) -> None:
    records = [json.loads(line) for line in SAMPLE.read_text().splitlines()[:8]]
    for i, record in enumerate(records):
        if i % 2 == 0:
            record["margin"] = 1.5 + i  # the others have none: margin 0
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in records))
    run = setup(train_cfg(*SMALL, f"data.pairs=[{{path: {pairs}}}]", "data.val_fraction=0", f"data.cache={cache}",
                          f"data.cache_dir={tmp_path / 'store'}", "data.batch_size=8"))
    run.datamodule.setup("fit")
    batch = next(iter(run.datamodule.train_dataloader()))
    rows = run.datamodule.train_rows
    expected = [rows[int(i)].get("margin", 0.0) for i in batch["index"]]
    assert sorted(expected) == [0.0] * 4 + [1.5, 3.5, 5.5, 7.5]
    assert batch["margin"].tolist() == expected
    with torch.no_grad():
        chosen, rejected = run.module.rewards(batch)
        loss, _ = run.module.step_loss(batch)
    want = -torch.nn.functional.logsigmoid(chosen - rejected - batch["margin"]).mean()
    assert float(loss) == pytest.approx(float(want), rel=1e-6)


@pytest.mark.parametrize(("override", "message"), [
    ("data.packing=true", "set data.packing=false"),
    ("objective.center_rewards_coefficient=-0.1", "center_rewards_coefficient must be >= 0"),
])
def test_settings_that_cannot_work_are_refused_before_loading(train_cfg, override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_train_config(train_cfg(*SMALL, override))


def test_a_bad_margin_names_the_record(train_cfg, tmp_path: Path) -> None:
    from rolemrc.data.schemas import RecordError, parse_pair

    record = json.loads(SAMPLE.read_text().splitlines()[0])
    with pytest.raises(RecordError, match="'margin' must be a finite number"):
        parse_pair({**record, "margin": "high"})
    assert parse_pair({**record, "margin": 2}).margin == 2.0


def test_the_memory_simulation_sizes_the_score_model(train_cfg) -> None:
    """``python -m rolemrc.memory objective=reward --simulate`` (and ``gradient_checkpointing=auto``)
    runs the reward step on the one-score classifier, not on a causal LM's vocabulary logits."""
    from tests.test_memory_sim import simulate

    sim = simulate(train_cfg(*SMALL, "data.max_length=64", "data.max_prompt_length=32"), checkpointing=False)
    assert sim.rows == 4 and sim.peak_bytes > 0
