"""env=llm_user: a language model plays the user, behind a loopback OpenAI-compatible server and as
a tiny local transformers model. Persona and goal from the row, the end marker, the cache, faults
(a failure is never a turn: the conversation is marked failed), templates checked before any request."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rolemrc import asset
from rolemrc.config import EnvConfig
from rolemrc.env import make_env, roll, summary
from rolemrc.errors import ConfigError, MissingAPIKey, ModelSourceError
from rolemrc.rollout.hf import stop_token_ids
from tests.env.test_rollout import Scripted, chat_of, rows


def user_env(fake_openai, api_key_env, tmp_path: Path | None = None, **user):
    cfg = OmegaConf.structured(EnvConfig(name="llm_user", max_turns=4))
    cfg.user.merge_with({"model": "user-model", "base_url": fake_openai.base_url, "api_key_env": api_key_env[0],
                         "backoff_s": 0.0, "max_backoff_s": 0.0, "max_attempts": 2, **user})
    return make_env(cfg, cache_dir=tmp_path)


def run(env, replies, max_turns=4):
    """Conversations of ``len(replies)`` rows, the role-player saying ``replies[i][turn]`` (or, given
    an int, that many conversations where it always says "Aye.")."""
    chat = chat_of("tiny-llama3")
    if isinstance(replies, int):
        n, policy = replies, lambda prompts: [chat.encode_response([{"role": "user", "content": "q"}], "Aye.")
                                              for _ in prompts]
    else:
        n, policy = len(replies), Scripted(chat, replies)
    return roll([env.reset(r) for r in rows(n)], chat, policy, stop_ids=stop_token_ids(chat.tokenizer, chat.eot),
                max_turns=max_turns)


def test_api_user_answers_ends_with_the_marker_and_caches(fake_openai, api_key_env, tmp_path) -> None:
    def answer(req):  # a question after the first reply, then the end marker
        return "Thanks! [END]" if "CHARACTER: answer 1" in req.last_content else "  Does the tide wait for anyone?\n"

    fake_openai._answer = answer
    env = user_env(fake_openai, api_key_env, tmp_path)
    replies = [[f"answer {t}" for t in range(4)] for _ in range(2)]
    convs = run(env, replies)
    assert [c.reason for c in convs] == ["user_end", "user_end"] and [c.turns for c in convs] == [2, 2]
    users = [m["content"] for m in convs[0].messages if m["role"] == "user"]
    assert users[1] == "Does the tide wait for anyone?"  # the user's turn as answered, stripped
    assert not any(c.failed for c in convs) and summary(convs)["failed"] == 0
    assert fake_openai.requests == 4
    assert "user-model" in fake_openai.models
    env.close()
    # a rerun asks nothing: every answer is cached
    env = user_env(fake_openai, api_key_env, tmp_path)
    again = run(env, replies)
    assert [c.messages for c in again] == [c.messages for c in convs] and fake_openai.requests == 4
    assert env.counts["cached"] == 4
    env.close()


def test_the_prompt_shows_persona_goal_character_script_and_transcript(fake_openai, api_key_env) -> None:
    env = user_env(fake_openai, api_key_env, goal="learn about knots")
    row = rows(1)[0]
    row["columns"]["user_persona"] = "a retired harbour pilot"
    ep = env.reset(row)
    msgs = env.prompt(ep, ep.opening, "Aye, shipmate.")
    system, prompt = msgs[0]["content"], msgs[1]["content"]
    assert "a retired harbour pilot" in system and "learn about knots" in system and "[END]" in system
    assert row["messages"][0]["content"] in system  # the character's profile
    assert all(t in system for t in row["columns"]["user_turns"])  # the dialogue's own later turns as a guide
    assert prompt.endswith("Write your message number 2 to the character (or [END] to end the conversation).")
    assert f"USER (you): {row['messages'][-1]['content']}\nCHARACTER: Aye, shipmate." in prompt
    env.close()


def test_a_failed_user_is_never_a_turn_and_marks_the_conversation(fake_openai, api_key_env) -> None:
    fake_openai._faults = lambda req: "server_error"
    env = user_env(fake_openai, api_key_env)
    convs = run(env, [["a", "b"], ["c", "d"]])
    assert [c.reason for c in convs] == ["user_failed", "user_failed"] and all(c.failed for c in convs)
    assert all(c.turns == 1 and c.messages[-1]["role"] == "assistant" for c in convs)  # no user turn added
    assert "server_error" in convs[0].error and summary(convs)["failed"] == 2
    assert fake_openai.requests == 4 and env.counts["server_error"] == 4  # max_attempts=2 per conversation
    env.close()
    # the budget: the second conversation's request is not sent
    fake_openai._faults = None
    env = user_env(fake_openai, api_key_env, max_requests=1)
    convs = run(env, 2, max_turns=2)
    assert sorted(c.reason for c in convs) == ["turn_cap", "user_budget"]
    env.close()


def test_templates_and_keys_are_checked_before_anything_is_sent(fake_openai, api_key_env, tmp_path,
                                                                monkeypatch) -> None:
    bad = tmp_path / "user.yaml"
    bad.write_text("system: You are {persona} with {mood}.\nprompt: '{transcript}'\n")
    with pytest.raises(ConfigError, match=r"user.yaml: system: unknown placeholder\(s\) \{mood\}"):
        user_env(fake_openai, api_key_env, template=str(bad))
    bad.write_text("system: You are {persona}.\nprompt: Say something.\n")
    with pytest.raises(ConfigError, match=r"prompt: the template never shows \{transcript\}"):
        user_env(fake_openai, api_key_env, template=str(bad))
    bad.write_text("system: You are {persona}.\n")
    with pytest.raises(ConfigError, match="missing key"):
        user_env(fake_openai, api_key_env, template=str(bad))
    with pytest.raises(ConfigError, match="env.user.backend"):
        user_env(fake_openai, api_key_env, backend="smoke")
    monkeypatch.delenv(api_key_env[0])
    with pytest.raises(MissingAPIKey, match=api_key_env[0]):
        user_env(fake_openai, api_key_env)
    assert fake_openai.requests == 0
    # the shipped template is valid as shipped
    from rolemrc.env.user import load_templates
    assert set(load_templates(asset("env/user.yaml"))) == {"system", "prompt"}


def test_a_local_model_plays_the_user(tmp_path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(asset("tokenizers/tiny-llama3"))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / "user")
    tok.save_pretrained(tmp_path / "user")
    cfg = OmegaConf.structured(EnvConfig(name="llm_user", max_turns=3))
    cfg.user.merge_with({"backend": "hf", "model": str(tmp_path / "user"), "max_tokens": 6, "device": "cpu"})

    def once():
        env = make_env(cfg)
        convs = run(env, [["a", "b", "c"], ["d", "e", "f"]], max_turns=3)
        env.close()
        return convs

    convs = once()
    assert [c.reason for c in convs] == ["turn_cap", "turn_cap"] and [c.turns for c in convs] == [3, 3]
    users = [[m["content"] for m in c.messages if m["role"] == "user"] for c in convs]
    assert all(len(u) == 3 and u[1].strip() for u in users)  # the model's sampled turns, in the conversation
    assert [c.messages for c in once()] == [c.messages for c in convs]  # seeded: the same run says the same
    cfg.user.model = str(tmp_path / "nothing")
    with pytest.raises(ModelSourceError, match="env.user.model=.*nothing: cannot be loaded"):
        make_env(cfg)


def test_grpo_trains_on_conversations_with_a_served_user_from_rolemrc_seeds(train_cfg, tmp_path, fake_openai,
                                                                          api_key_env, monkeypatch) -> None:
    """python train.py objective=grpo env=llm_user data=rolemrc_dialogues_sample, in process, the user
    behind the loopback server: conversations of two turns, the seeds' personas in the user's
    prompts, every answer cached in the run's folder."""
    from rolemrc.modules.grpo import GRPOModule
    from rolemrc.run.train import run
    from tests.train.helpers import metric_rows
    from tests.train.test_grpo_multiturn import MT, rng_generate

    monkeypatch.setattr(GRPOModule, "generate", rng_generate)
    prompts: list[str] = []

    def answer(req):
        prompts.append(req.body["messages"][0]["content"])
        return "And what happened next?"

    fake_openai._answer = answer
    cfg = train_cfg(*[o for o in MT if not o.startswith(("data=", "env="))], "data=rolemrc_dialogues_sample",
                    "env=llm_user", "env.max_turns=2", "env.user.model=user-model",
                    f"env.user.base_url={fake_openai.base_url}", f"env.user.api_key_env={api_key_env[0]}",
                    "trainer.max_steps=1", "data.shuffle=false")
    out = run(cfg)
    rows = [r for r in metric_rows(Path(out["run_dir"])) if "train/loss" in r]
    assert len(rows) == 1 and rows[0]["train/turns/max"] == 2
    assert fake_openai.requests == len(prompts) > 0 and "user-model" in fake_openai.models
    # the first two seeds (no shuffling): the second has its own persona, the first the config's
    assert any("a nervous first-time baker" in p for p in prompts) and any("a curious visitor" in p for p in prompts)
    assert list(Path(out["run_dir"]).rglob("user_cache.sqlite"))
