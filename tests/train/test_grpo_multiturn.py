"""objective=grpo / rloo with env=scripted: groups of whole conversations per seed, the loss on the
role-player's tokens only, rewards per turn aggregated per conversation. Invariances: one turn
equals single-turn GRPO on the same data and seed; the same update however the step is cut into
micro-batches; a crash and resume gives the uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from rolemrc.objectives.logprobs import IGNORE_INDEX
from rolemrc.run.train import run, setup
from tests.train.helpers import metric_rows, series

pytestmark = pytest.mark.xdist_group("grpo")

MT = ["objective=grpo", "data=sample_dialogues", "data.batch_size=2", "objective.num_generations=3",
      "objective.max_completion_length=6", "export.enabled=false", "optim.warmup_ratio=0", "optim.scheduler=constant",
      "+objective.rewards.vowels._target_=tests.train.test_grpo.vowel_reward", "env=scripted"]
REPLY = 6  # objective.max_completion_length


def _eot(module: Any) -> int:
    return module.chat.tokenize(module.chat.eot)[0]


def rng_generate(self: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sample: bool = True) -> torch.Tensor:
    """Replies drawn from torch's RNG (the rollout's stream, as generate draws): random tokens, most
    ended by the end-of-turn token within ``REPLY`` tokens, the others cut there."""
    n = prompt_ids.shape[0]
    rows = torch.randint(10, 300, (n, REPLY))
    stop = torch.randint(0, REPLY + 2, (n,))
    for i in range(n):
        if stop[i] < REPLY:
            rows[i, stop[i]] = _eot(self)
    return rows


def keyed_generate(self: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sample: bool = True) -> torch.Tensor:
    """Replies that depend only on the conversation so far and the copy's place among identical ones
    next to each other (not on the batch they are generated in)."""
    rows, previous, copy = [], None, 0
    for ids, mask in zip(prompt_ids, prompt_mask):
        prompt = ids[mask.bool()]
        key = int((prompt * torch.arange(1, len(prompt) + 1)).sum()) % 100_003
        copy = copy + 1 if key == previous else 0
        previous = key
        gen = torch.Generator().manual_seed(key * 10 + copy)
        row = torch.randint(10, 300, (REPLY,), generator=gen)
        stop = int(torch.randint(0, REPLY + 2, (1,), generator=gen))
        if stop < REPLY:
            row[stop] = _eot(self)
        rows.append(row)
    return torch.stack(rows)


def test_one_turn_equals_single_turn_grpo(train_cfg, tmp_path: Path, monkeypatch) -> None:
    """env.max_turns=1 samples from the same stream, lays out, scores and trains as env=none on the
    same prompts and seed: the same losses, metrics and weights."""
    from rolemrc.modules.grpo import GRPOModule

    monkeypatch.setattr(GRPOModule, "generate", rng_generate)
    results = {}
    for env in ("none", "scripted"):
        cfg = train_cfg(*MT[:-1], f"env={env}", "env.max_turns=1", "trainer.max_steps=2", "data.val_fraction=0.25",
                        "trainer.val_check_interval=2")
        cfg.run_dir = str(tmp_path / env)
        out = run(cfg)
        state = torch.load(Path(out["run_dir"]) / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
        results[env] = (metric_rows(Path(out["run_dir"])), state, out["summary"]["val_metrics"])
    (single, w1, val1), (multi, w2, val2) = results["none"], results["scripted"]
    # validation plays conversations as training does: one turn samples and scores what env=none does
    assert val1 and val1.keys() == val2.keys() and val1["val/completions/mean_length"] > 0
    for key, value in val1.items():
        assert val2[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    single = [r for r in single if "train/loss" in r]
    multi = [r for r in multi if "train/loss" in r]
    assert len(single) == len(multi) == 2
    for a, b in zip(single, multi):
        for key, value in a.items():
            if key.endswith("_per_s") or key == "epoch":
                continue
            assert b[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        assert b["train/turns/max"] == 1 and b["train/rewards/vowels/turn_1"] == pytest.approx(
            a["train/rewards/vowels/mean"])
    assert any(r["train/loss"] != 0 for r in single) and 0 < single[0]["train/completions/clipped_ratio"] < 1
    for name, w in w1.items():
        assert torch.allclose(w, w2[name], rtol=1e-5, atol=1e-7), name


def test_same_update_however_the_step_is_cut_and_only_the_role_players_tokens_train(
        train_cfg, tmp_path: Path, monkeypatch) -> None:
    """4 seeds a step as (4 x 1), (2 x 2), (1 x 4) micro-batch x accumulation, conversations of up to
    3 turns that depend on the conversation only: the same rollouts, losses and update. The labels are
    the role-player's sampled tokens only (the user's turns and template tokens are context); the
    conversation metrics are logged."""
    from rolemrc.modules.grpo import GRPOModule

    monkeypatch.setattr(GRPOModule, "generate", keyed_generate)
    laid: list[dict[str, Any]] = []
    score = GRPOModule.score_conversations

    def spy(self, batch, convs, seconds=float("nan")):
        out = score(self, batch, convs, seconds)
        laid.append({"convs": convs, "labels": out["labels"].clone(), "width": batch["prompt_ids"].shape[1]})
        return out

    monkeypatch.setattr(GRPOModule, "score_conversations", spy)
    results = {}
    for b, a in [(4, 1), (2, 2), (1, 4)]:
        cfg = train_cfg(*MT, f"data.batch_size={b}", f"trainer.accumulate_grad_batches={a}", "trainer.max_steps=2",
                        "optim.eps=1.0", "optim.lr=1.0", "trainer.gradient_clip_val=null", "env.max_turns=3")
        cfg.run_dir = str(tmp_path / f"{b}x{a}")
        out = run(cfg)
        run_dir = Path(out["run_dir"])
        state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
        results[(b, a)] = (state, [r for r in metric_rows(run_dir) if "train/loss" in r])
    state0, rows0 = results[(4, 1)]
    assert len(laid) == 6  # one rollout per step, the step's 4 seeds x 3 conversations at once
    for key, (state, rows) in results.items():
        for r, r0 in zip(rows, rows0, strict=True):
            for name in ("train/loss", "train/reward", "train/turns/mean", "train/completions/mean_length"):
                assert r[name] == pytest.approx(r0[name], rel=1e-5, abs=1e-8), (key, name)
        for name, w in state.items():
            assert torch.allclose(w, state0[name], rtol=1e-4, atol=1e-6), (key, name)
    convs = [c for step in laid for c in step["convs"]]
    assert max(c.turns for c in convs) == 3 and {c.reason for c in convs} >= {"turn_cap", "truncated"}
    for step in laid:
        for i, c in enumerate(step["convs"]):
            done, mask = c.completion
            labels = step["labels"][i, step["width"]:step["width"] + len(done)].tolist()
            assert labels == [t if m else IGNORE_INDEX for t, m in zip(done, mask)]
            assert 0 < sum(mask) < len(done) or c.turns == 1  # later turns: user tokens in the sequence, not trained
    rows = rows0
    turns = [c.turns for c in laid[0]["convs"]]
    assert rows[0]["train/turns/mean"] == pytest.approx(sum(turns) / len(turns))
    assert rows[0]["train/turns/max"] == max(turns)
    ends = [c.reason for c in laid[0]["convs"]]
    assert all(rows[0][f"train/ends/{e}"] == ends.count(e) for e in set(ends))
    assert "train/rewards/vowels/turn_2" in rows[0] and "train/noncanonical_replies" in rows[0]
    lengths = [sum(c.completion[1]) for c in laid[0]["convs"]]  # TRL's: the role-player's tokens (env_mask)
    assert rows[0]["train/completions/mean_length"] == pytest.approx(sum(lengths) / len(lengths))


def test_crash_and_resume_gives_the_uninterrupted_conversations(tmp_path: Path, monkeypatch) -> None:
    """objective=rloo with env=scripted, mask_truncated_completions and the last turn's reward: a run
    crashed at step 3 and resumed from its step-2 checkpoint logs what the uninterrupted run logs."""
    from rolemrc.modules.grpo import GRPOModule
    from tests.conftest import FAST, compose_train

    monkeypatch.setattr(GRPOModule, "generate", rng_generate)
    common = [*FAST, *MT, "objective=rloo", "trainer.max_steps=4", "runtime.checkpoint_every_n_steps=2",
              "env.turn_rewards=last", "objective.mask_truncated_completions=true", "objective.beta=0"]
    reference = run(compose_train(common, run_dir=tmp_path / "reference"))
    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="crash at step 3"):
        run(compose_train([*common, "+callbacks.crash._target_=tests.train.test_grpo.CrashAt",
                           "+callbacks.crash.step=3"], run_dir=crashed))
    run(compose_train([*common, "ckpt_path=last"], run_dir=crashed))
    for key in ("train/loss", "train/reward", "train/turns/mean", "train/rewards/vowels/turn_1",
                "train/completions/mean_length", "train/num_tokens"):
        want, got = series(Path(reference["run_dir"]), key), series(crashed, key)
        assert len(want) == 4 and got == pytest.approx(want, abs=1e-6, nan_ok=True), key
    assert len(set(series(crashed, "train/turns/mean"))) > 1  # conversations differ from step to step


def test_checks_before_anything_loads(train_cfg, tmp_path: Path) -> None:
    from rolemrc.config import check_train_config
    from rolemrc.errors import ConfigError

    for overrides, message in ((["objective=dpo", "env=scripted"], "env=scripted (multi-turn conversations) trains "
                                "with objective=grpo or objective=rloo, not objective=dpo"),
                               ([*MT, "env.turn_rewards=max"], "env.turn_rewards must be one of mean, last, min, sum"),
                               ([*MT, "env.conversation_rewards=[judge]"],
                                "env.conversation_rewards names 'judge', not a reward of objective.rewards")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_train_config(train_cfg(*overrides))
    check_train_config(train_cfg(*MT, "objective=rloo", "env.conversation_rewards=[vowels]"))
    # a seed without user_turns is one turn; a malformed one is named by file and line
    seeds = tmp_path / "seeds.jsonl"
    good = {"prompt": [{"role": "user", "content": "Hello there?"}]}
    seeds.write_text(json.dumps(good) + "\n" + json.dumps({**good, "user_turns": ["fine", 3]}) + "\n")
    parts = setup(train_cfg(*MT, f"data.prompts=[{{path: {seeds}}}]"))
    with pytest.raises(Exception, match=r"seeds\.jsonl:2.*user_turns"):
        parts.datamodule.setup()


def test_turn_rewards_aggregate_per_conversation_and_whole_conversation_rewards_see_it_all() -> None:
    from rolemrc.rewards import RewardSet
    from rolemrc.rewards.turns import score_dialogues

    seen: list[tuple[int, str]] = []

    def per_turn(*, prompts, completions, **columns):
        return [float(len(c)) if c != "-" else None for c in completions]

    def whole(*, prompts, completions, **columns):
        seen.extend((len(p), c) for p, c in zip(prompts, completions))
        return [1.0] * len(completions)

    rewards = RewardSet({"len": per_turn, "judge": whole}, {"len": 1.0, "judge": 2.0})
    opening = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}]
    dialogue = [*opening, {"role": "assistant", "content": "aa"}, {"role": "user", "content": "u2"},
                {"role": "assistant", "content": "-"}, {"role": "user", "content": "u3"},
                {"role": "assistant", "content": "aaaa"}]
    one = [*opening, {"role": "assistant", "content": "a"}]
    for how, value in (("mean", 3.0), ("last", 4.0), ("min", 2.0), ("sum", 6.0)):
        got = score_dialogues(rewards, [dialogue, one], [3, 1], {"task": ["t", "t"]}, how=how, whole=["judge"])
        assert got.scores.per_reward[:, 0].tolist() == [value, 1.0], how
        assert got.scores.rewards.tolist() == [value + 2.0, 3.0]
        assert got.turn_index.tolist() == [1, 2, 3, 1] and torch.isnan(got.turn_values[1, 0])
        assert torch.isnan(got.turn_values[:, 1]).all()  # the whole-conversation reward: not per turn
    assert seen[:2] == [(6, "aaaa"), (2, "a")]  # the last reply, after everything before it


def test_a_failed_user_is_neither_scored_nor_trained_and_all_failing_stops() -> None:
    from types import SimpleNamespace

    from rolemrc.env import Conversation
    from rolemrc.env.sampler import lay_out
    from rolemrc.modules.scoring import Scorer
    from rolemrc.rewards import RewardSet
    from rolemrc.rollout import RolloutError

    calls: list[int] = []

    def length(*, prompts, completions, **columns):
        calls.append(len(completions))
        return [float(len(c)) for c in completions]

    opening = [{"role": "user", "content": "u1"}]
    ok = Conversation([*opening, {"role": "assistant", "content": "abc"}], [1, 2, 7, 8, 4], 2, [0, 0, 1, 1, 1],
                      [(2, 5)], [{}], "script_end")
    failed = Conversation([*opening, {"role": "assistant", "content": "ab"}], [1, 2, 7, 4], 2, [0, 0, 1, 1],
                          [(2, 4)], [{}], "user_failed", error="HTTP 503")
    scorer = Scorer(None, RewardSet({"len": length}), SimpleNamespace(turn_rewards="mean", conversation_rewards=[]))
    got = scorer.conversations([ok, failed], {"task": ["t", "t"]})
    assert calls == [1] and got.scores.rewards[0] == 3.0 and torch.isnan(got.scores.rewards[1])
    laid = lay_out([ok, failed], pad_id=0, prompt_width=2)
    assert laid["labels"][0].tolist() == [-100, -100, 7, 8, 4] and (laid["labels"][1] == -100).all()
    with pytest.raises(RolloutError, match="user failed in all 1 conversations of the step \\(user_failed: HTTP 503\\)"):
        scorer.conversations([failed], {"task": ["t"]})


class RecordSequences(L.Callback):
    """Every trained row's tokens (padding dropped) and labels."""

    rows: list[tuple[list[int], list[int]]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        for ids, att, lab in zip(batch["input_ids"], batch["attention_mask"], batch["labels"]):
            RecordSequences.rows.append((ids[att.bool()].tolist(), lab[att.bool()].tolist()))


class KeyedRollouts(L.Callback):
    """The policy's replies are :func:`keyed_generate`'s (in a train.py process, on every rank)."""

    def setup(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        pl_module.generate = types.MethodType(keyed_generate, pl_module)


def test_another_engine_syncs_once_per_step_and_seeds_every_turn(tmp_path: Path, monkeypatch) -> None:
    """objective.rollout=vllm (a loopback server): the adapter synced once per step, one request per open
    conversation per turn (n=1, its own seed from the rollout's stream), each turn's prompt the
    conversation so far, and the labels exactly the server's replies, turn after turn. The engine is
    built for the longest turn (a reply after env.max_tokens, default data.max_length, of conversation)."""
    import rolemrc.modules.grpo as grpo
    from tests.conftest import FAST, compose_train
    from tests.train.test_grpo_vllm import VLLMStub, _tiny_vocab

    made: list[dict[str, Any]] = []
    make_engine = grpo.make_engine
    monkeypatch.setattr(grpo, "make_engine", lambda objective, **kw: made.append(kw) or make_engine(objective, **kw))
    stub = VLLMStub(vocab=_tiny_vocab())
    RecordSequences.rows = []
    try:
        run(compose_train([*FAST, *MT, "model.peft.enabled=true", "objective.rollout=vllm",
                           f"objective.vllm.base_url={stub.url}", "trainer.max_steps=2", "env.max_turns=3",
                           "+callbacks.rec._target_=tests.train.test_grpo_multiturn.RecordSequences"],
                          run_dir=tmp_path / "run"))
    finally:
        stub.close()
    assert len(stub.loads) == 2  # one sync per step, not per turn
    assert [kw["max_model_len"] for kw in made] == [1024 + REPLY]  # data=sample_dialogues: max_length 1024
    bodies = [c["body"] for c in stub.completions]
    assert all(b["n"] == 1 for b in bodies) and len({b["seed"] for b in bodies}) == len(bodies)
    served = [(b["prompt"], c["rows"][0]) for b, c in zip(bodies, stub.completions)]
    assert len(RecordSequences.rows) == 12 and len(bodies) > 12  # later turns were asked for
    used = 0
    for ids, labels in RecordSequences.rows:
        # the replies served for this conversation: their prompt is the sequence so far, the reply follows it
        replies = sorted(((p, row) for p, row in served if p == ids[:len(p)] and ids[len(p):len(p) + len(row)] == row),
                         key=lambda r: len(r[0]))
        assert replies and len(replies[0][0]) < len(ids)
        used += len(replies)
        assert [t for t in labels if t != IGNORE_INDEX] == [t for _, row in replies for t in row]
    assert used == len(served)  # every request was one turn of one trained conversation


def test_trls_grpo_trainer_given_the_same_conversations_through_rollout_func_agrees(train_cfg, tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """TRL 1.16's GRPOTrainer, handed our step's conversations through its experimental ``rollout_func``
    (prompt ids, completion ids, ``env_mask`` = the role-player's tokens) and our conversation rewards,
    computes the same loss and the same reward, completion and loss metrics."""
    import copy

    trl = pytest.importorskip("trl")
    assert trl.__version__ == "1.16.0", "rollout_func's contract is TRL 1.16.0's"
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rolemrc.modules.grpo import GRPOModule
    from rolemrc.modules.scoring import rollout_metrics

    monkeypatch.setattr(GRPOModule, "generate", keyed_generate)
    parts = setup(train_cfg(*MT, "env.max_turns=3", "objective.loss_type=dapo", "data.batch_size=2"))
    module, dm = parts.module, parts.datamodule
    module._chat = parts.chat
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    rolled: dict[str, Any] = {}
    score = GRPOModule.score_conversations

    def spy(self, batch, convs, seconds=float("nan")):
        out = score(self, batch, convs, seconds)
        rolled.update(convs=convs, rewards=out["rollout_stats"]["rewards"].tolist())
        return out

    monkeypatch.setattr(GRPOModule, "score_conversations", spy)
    theirs_model = copy.deepcopy(module.model)
    loss, _ = module.step_loss(batch)
    ours = {**rollout_metrics(module._step_stats), **GRPOModule._loss_metrics([module._loss_stats])}
    ours["num_tokens"] = sum(s["prompt_tokens"] + int(s["lengths"].sum()) for s in module._step_stats)  # as logged
    convs, rewards = rolled["convs"], rolled["rewards"]
    assert max(c.turns for c in convs) > 1 and len(set(rewards)) > 1

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        assert len(prompts) == len(convs)
        return {"prompt_ids": [c.ids[:c.prompt_len] for c in convs], "completion_ids": [c.completion[0] for c in convs],
                "logprobs": None, "env_mask": [c.completion[1] for c in convs]}

    def conversation_reward(*, prompts: list[Any], completions: list[Any], **kw: Any) -> list[float]:
        return list(rewards)

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    n = len(convs)
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, fp16=False, report_to=[],
                      per_device_train_batch_size=n, gradient_accumulation_steps=1, steps_per_generation=1,
                      num_generations=module.objective.num_generations, max_completion_length=64, temperature=1.0,
                      loss_type="dapo", beta=0.0, epsilon=0.2, num_iterations=1, scale_rewards="group",
                      activation_checkpointing=False, logging_steps=1, save_strategy="no", disable_tqdm=True)
    seeds = [{"prompt": messages} for messages in batch["prompts"]]
    trainer = GRPOTrainer(model=theirs_model, reward_funcs=[conversation_reward], args=args,
                          train_dataset=Dataset.from_list(seeds), processing_class=parts.chat.tokenizer,
                          rollout_func=rollout_func)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop
    inputs = trainer._generate_and_score_completions([s for s in seeds for _ in range(module.objective.num_generations)])
    expected = trainer.compute_loss(trainer.model, inputs)
    logged = {k: v[-1] if isinstance(v, list) else v for k, v in trainer._metrics["train"].items()}
    assert float(loss) == pytest.approx(float(expected), rel=1e-5, abs=1e-7) and abs(float(loss)) > 1e-6
    loss.backward()
    expected.backward()
    ours_grads = dict(module.model.named_parameters())
    for name, p in trainer.model.named_parameters():
        assert torch.allclose(ours_grads[name].grad, p.grad, rtol=1e-4, atol=1e-7), name
    for name in ("reward", "reward_std", "frac_reward_zero_std", "num_tokens", "completions/mean_length",
                 "completions/min_length", "completions/max_length", "completions/clipped_ratio",
                 "completions/mean_terminated_length", "entropy", "clip_ratio/region_mean"):
        assert ours[name] == pytest.approx(float(logged[name]), rel=1e-5, abs=1e-6), name


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_give_one_ranks_update(tmp_path: Path, monkeypatch) -> None:
    """DDP on two CPU ranks (2 seeds each) and one rank with their 4 seeds a step, conversations that
    depend on the conversation only: the same losses, conversation and reward metrics (gathered over
    the ranks) and weights."""
    from rolemrc.modules.grpo import GRPOModule
    from tests.conftest import FAST, ROOT, compose_train

    args = [*FAST, *MT, "env.max_turns=3", "trainer.max_steps=2", "optim.eps=1.0", "optim.lr=1.0",
            "trainer.gradient_clip_val=null"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "train.py", *args, "trainer.devices=2", "trainer.accelerator=cpu",
                           "strategy=ddp", "+callbacks.keyed._target_=tests.train.test_grpo_multiturn.KeyedRollouts",
                           f"hydra.run.dir={tmp_path / 'ddp'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    monkeypatch.setattr(GRPOModule, "generate", keyed_generate)
    run(compose_train([*args, "data.batch_size=4"], run_dir=tmp_path / "one"))
    ddp, one = ([r for r in metric_rows(tmp_path / name) if "train/loss" in r] for name in ("ddp", "one"))
    assert len(ddp) == len(one) == 2
    keys = [k for k in one[0] if k.startswith("train/") and k not in ("train/completion_tokens_per_s", "train/lr")]
    assert {"train/turns/mean", "train/rewards/vowels/turn_2", "train/ends/truncated"} <= set(keys)
    for key in keys:
        assert [r[key] for r in ddp] == pytest.approx([r[key] for r in one], rel=1e-4, abs=1e-6), key
    assert one[0]["train/turns/max"] > 1
    states = [torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
              for name in ("ddp", "one")]
    for name, w in states[1].items():
        torch.testing.assert_close(states[0][name], w, rtol=1e-4, atol=1e-5, msg=name)
