"""The multi-turn rollout (rolemrc.env.roll): one token sequence per conversation, the role-player's
tokens masked in, equal to the chat template's tokenisation of the final conversation on the
Llama-3 and ChatML (Qwen) templates; the caps and stop handling, each with its reason."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from rolemrc import asset
from rolemrc.data.templates import ChatFormat
from rolemrc.env import ScriptedEnv, roll, summary
from rolemrc.env.base import EnvError
from rolemrc.objectives.logprobs import IGNORE_INDEX
from rolemrc.rollout.hf import stop_token_ids

ROWS = [json.loads(line) for line in open(asset("sample/dialogues.jsonl"), encoding="utf-8")][:3]


def chat_of(name: str) -> ChatFormat:
    return ChatFormat(AutoTokenizer.from_pretrained(asset(f"tokenizers/{name}")))


def rows(n: int = 3) -> list[dict]:
    return [{"messages": [{"role": m["role"].lower(), "content": m["content"]} for m in r["prompt"]],
             "columns": {"user_turns": r["user_turns"]}} for r in ROWS[:n]]


class Scripted:
    """A policy that says the given texts in turn (``replies[i][turn]`` in conversation ``i``), sampled as
    the template tokenises a reply's text (a reply's tokens do not depend on the turns before it)."""

    def __init__(self, chat: ChatFormat, replies: list[list[str]]) -> None:
        self.chat, self.replies, self.turn = chat, replies, 0

    def __call__(self, prompts: list[list[int]]) -> list[list[int]]:
        assert len(prompts) == len(self.replies)  # conversations of equal length: all open together
        out = [self.chat.encode_response([{"role": "user", "content": "q"}], r[self.turn]) for r in self.replies]
        self.turn += 1
        return out


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-chatml"])
def test_conversation_tokens_equal_the_templates_tokenisation(name: str) -> None:
    chat = chat_of(name)
    env = ScriptedEnv()
    episodes = [env.reset(r) for r in rows()]
    replies = [[f"Aye, answer {t} of {i}, shipmate." for t in range(3)] for i in range(3)]
    convs = roll(episodes, chat, Scripted(chat, replies),
                 stop_ids=stop_token_ids(chat.tokenizer, chat.eot), max_turns=5)
    for conv, row in zip(convs, rows(), strict=True):
        assert conv.reason == "script_end" and conv.turns == 3 and conv.noncanonical == 0
        users = [m["content"] for m in conv.messages if m["role"] == "user"]
        assert users == [row["messages"][-1]["content"], *row["columns"]["user_turns"]]
        whole = chat.encode_conversation(conv.messages)
        assert whole.input_ids[:len(conv.ids)] == conv.ids
        assert chat.tokenize(chat.render(conv.messages))[:len(conv.ids)] == conv.ids
        assert [int(label != IGNORE_INDEX) for label in whole.labels[:len(conv.ids)]] == conv.model_mask
        assert conv.ids[:conv.prompt_len] == chat.encode_prompt(row["messages"])
        # every turn's prompt was the sequence so far: each reply starts where a generation prompt ends
        for k, (start, end) in enumerate(conv.replies):
            upto = [m for m in conv.messages][:len(row["messages"]) + 2 * k]
            assert conv.ids[:start] == chat.encode_prompt(upto)
    assert summary(convs) == {"turns_mean": 3.0, "turns_max": 3, "ends": {"script_end": 3}, "noncanonical_replies": 0,
                             "failed": 0}


def test_caps_and_stops_end_conversations_with_their_reason() -> None:
    chat = chat_of("tiny-llama3")
    stops = stop_token_ids(chat.tokenizer, chat.eot)
    env = ScriptedEnv()

    def run(replies, **kw):
        episodes = [env.reset(r) for r in rows(len(replies))]
        return roll(episodes, chat, Scripted(chat, replies), stop_ids=stops, **kw)

    assert [c.reason for c in run([["a", "b", "c"]], max_turns=2)] == ["turn_cap"]
    assert run([["a", "b", "c"]], max_turns=2)[0].turns == 2
    # a reply without a stop token (max_new_tokens reached) ends it: cut, the last reply unfinished
    episodes = [env.reset(r) for r in rows(1)]
    conv = roll(episodes, chat, lambda p: [chat.tokenize("no stop here")], stop_ids=stops, max_turns=3)[0]
    assert (conv.reason, conv.turns, conv.cut) == ("truncated", 1, True)
    # a stop token other than the template's end of turn (an eos of its own): the conversation cannot go on
    other = chat.tokenize("zz")[-1]
    conv = roll([env.reset(rows(1)[0])], chat, lambda p: [chat.tokenize("bye") + [other]], stop_ids=[*stops, other],
                max_turns=3)[0]
    assert (conv.reason, conv.turns, conv.messages[-1]["content"].strip()) == ("stop", 1, "bye")
    # the length cap: the reply is cut at it, or the user's next turn does not fit
    first = roll([env.reset(rows(1)[0])], chat, lambda p: [chat.encode_response([], "x")], stop_ids=stops,
                 max_turns=1)[0]
    conv = roll([env.reset(rows(1)[0])], chat, lambda p: [chat.tokenize("a b c d e f g h i j k")], stop_ids=stops,
                max_turns=3, max_tokens=first.prompt_len + 3)[0]
    assert (conv.reason, len(conv.ids), sum(conv.model_mask)) == ("length_cap", first.prompt_len + 3, 3)
    conv = roll([env.reset(rows(1)[0])], chat, lambda p: [chat.encode_response([], "ok")], stop_ids=stops,
                max_turns=3, max_tokens=first.prompt_len + 8)[0]
    assert (conv.reason, conv.turns) == ("length_cap", 1)
    assert len(conv.ids) <= first.prompt_len + 8


def test_one_turn_is_the_prompt_and_the_sampled_reply_as_sampled() -> None:
    chat = chat_of("tiny-chatml")
    stops = stop_token_ids(chat.tokenizer, chat.eot)
    odd = chat.tokenize("A") + chat.tokenize("ye") + chat.tokenize(chat.eot)  # maybe not the template's split
    conv = roll([ScriptedEnv().reset(rows(1)[0])], chat, lambda p: [odd], stop_ids=stops, max_turns=1)[0]
    assert conv.completion == (odd, [1] * len(odd))
    assert conv.noncanonical == int(odd != chat.encode_response(rows(1)[0]["messages"], "Aye"))


def test_a_bad_script_or_opening_is_refused_before_any_reply() -> None:
    with pytest.raises(EnvError, match="user_turns"):
        ScriptedEnv().reset({"messages": rows(1)[0]["messages"], "columns": {"user_turns": "not a list"}})
    with pytest.raises(EnvError, match="user message"):
        ScriptedEnv().reset({"messages": [{"role": "system", "content": "x"}], "columns": {}})
