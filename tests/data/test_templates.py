"""Loss masks cover exactly the assistant turns plus their end-of-turn token."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from rolemrc import asset
from rolemrc.data.templates import ChatFormat
from rolemrc.objectives import IGNORE_INDEX

FORMATS = {"llama3": ("tiny-llama3", "<|eot_id|>"), "chatml": ("tiny-chatml", "<|im_end|>")}

USER_FIRST = [
    {"role": "system", "content": "You are Captain Mira, a lighthouse keeper who speaks in short, salty sentences."},
    {"role": "user", "content": "What do you see tonight?"},
    {"role": "assistant", "content": "(She squints at the sea) Fog, lad. Thick as chowder."},
    {"role": "user", "content": "Will the ships be safe?"},
    {"role": "assistant", "content": "Aye, the lamp burns bright. None will founder on my watch."},
]
ASSISTANT_FIRST = [
    {"role": "system", "content": "You are Chef Bruno, a pastry chef with a booming voice."},
    {"role": "assistant", "content": "Welcome to my kitchen! Mind the flour!"},
    {"role": "user", "content": "What are you baking?"},
    {"role": "assistant", "content": "Croissants, my friend: butter, patience, and more butter!"},
]

# An opening assistant turn and no System turn: nothing precedes the first reply but what the
# template itself writes (BOS, a default system prompt, the assistant header).
ASSISTANT_FIRST_NO_SYSTEM = ASSISTANT_FIRST[1:]


def chat_format(name: str) -> ChatFormat:
    return ChatFormat(AutoTokenizer.from_pretrained(asset(f"tokenizers/{FORMATS[name][0]}")))


def labelled_segments(ids: list[int], labels: list[int]) -> list[list[int]]:
    """Maximal runs of consecutive labelled positions."""
    runs: list[list[int]] = []
    prev = False
    for tok, lab in zip(ids, labels):
        on = lab != IGNORE_INDEX
        if on:
            assert lab == tok, "labels must equal input ids where trained (shift happens in the loss)"
            if not prev:
                runs.append([])
            runs[-1].append(tok)
        prev = on
    return runs


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("conv", [USER_FIRST, ASSISTANT_FIRST, ASSISTANT_FIRST_NO_SYSTEM],
                         ids=["user_first", "assistant_first", "assistant_first_no_system"])
def test_labels_are_exactly_assistant_turns(fmt: str, conv: list[dict]) -> None:
    chat = chat_format(fmt)
    eot = FORMATS[fmt][1]
    assert chat.eot == eot
    enc = chat.encode_conversation(conv)
    segments = labelled_segments(enc.input_ids, enc.labels)
    expected = [m["content"] + eot for m in conv if m["role"] == "assistant"]
    decoded = [chat.tokenizer.decode(seg) for seg in segments]
    assert decoded == expected
    # Every other token (system, user, headers, the newline after <|im_end|>) is masked.
    n_assistant = sum(len(s) for s in segments)
    assert enc.n_trained == n_assistant
    # And the whole row still decodes to the rendered conversation.
    assert chat.tokenizer.decode(enc.input_ids) == chat.render(conv)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_left_truncation_keeps_the_end(fmt: str) -> None:
    chat = chat_format(fmt)
    full = chat.encode_conversation(USER_FIRST)
    cut = chat.encode_conversation(USER_FIRST, max_length=20)
    assert cut.truncated and len(cut.input_ids) == 20
    assert cut.input_ids == full.input_ids[-20:] and cut.labels == full.labels[-20:]
    # A cut that leaves only context has nothing to train on.
    only_context = chat.encode_conversation(USER_FIRST[:3] + [USER_FIRST[3]], max_length=4)
    assert only_context.n_trained == 0


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_prompt_tokens_match_generation_and_pairs(fmt: str) -> None:
    chat = chat_format(fmt)
    prompt = USER_FIRST[:4]
    rendered = chat.render(prompt, add_generation_prompt=True)
    assert chat.encode_prompt(prompt) == chat.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    pair = chat.encode_pair(prompt, "Aye, safe as houses.", "Yes.", max_length=8192, max_prompt_length=4096)
    assert pair.prompt_ids == chat.encode_prompt(prompt)
    assert chat.tokenizer.decode(pair.chosen_ids) == "Aye, safe as houses." + FORMATS[fmt][1]
    assert chat.tokenizer.decode(pair.rejected_ids) == "Yes." + FORMATS[fmt][1]


def test_pair_truncation_cuts_prompt_left_then_responses_right() -> None:
    chat = chat_format("llama3")
    prompt = USER_FIRST[:4]
    full = chat.encode_pair(prompt, "Aye, safe as houses tonight.", "Yes.", 8192, 4096)
    cut = chat.encode_pair(prompt, "Aye, safe as houses tonight.", "Yes.", max_length=len(full.prompt_ids[-30:]) + 3,
                           max_prompt_length=30)
    assert cut.prompt_truncated and cut.prompt_ids == full.prompt_ids[-30:]
    assert cut.response_truncated and cut.chosen_ids == full.chosen_ids[:3]


def test_template_without_chat_template_is_a_clear_error() -> None:
    tok = AutoTokenizer.from_pretrained(asset("tokenizers/tiny-llama3"))
    tok.chat_template = None
    with pytest.raises(ValueError, match="model.chat_template"):
        ChatFormat(tok)
    # ... and a shipped template name fixes it.
    assert ChatFormat(tok, template="chatml").eot == "<|im_end|>"
