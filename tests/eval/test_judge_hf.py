"""The local transformers judge backend, with a tiny random-init Llama and a BPE tokenizer."""

from __future__ import annotations

import pytest
import torch

from rolemrc.eval.judge import HFBackend, Judge, aggregate, judge_items

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_judge() -> tuple[object, object]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|end|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ["VERDICT: 1", "VERDICT: 0", "The captain says arr.", "Judge the reply on one criterion."] * 20
    bpe.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|end|>", pad_token="<|pad|>")
    tok.chat_template = CHAT_TEMPLATE

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(cfg).eval()
    return model, tok


def test_hf_judge_garbage_is_unparseable_and_not_cached(tiny_judge, tmp_path, monkeypatch, capsys):
    model, tok = tiny_judge
    test_items = [
        {
            "task": "role_related_mrc_answer_with_narration",  # KB + RS
            "question": [
                {"role": "System", "content": "You are Captain Mora."},
                {"role": "User", "content": "When did the ship sail?"},
                {"role": "Assistant", "content": "Arr, ask me again."},
                {"role": "User", "content": "When?"},
            ],
            "reference": "1820.",
        },
        {
            "task": "role_related_mrc_answer_no_narration-special-format",  # NI
            "question": [{"role": "System", "content": "Answer in capitals."}, {"role": "User", "content": "Hi"}],
            "reference": "HELLO.",
        },
    ]
    items = judge_items(test_items, ["It sailed in 1820.", "HELLO"])
    backend = HFBackend(model, tok, model_id="tiny-random-llama", max_new_tokens=8)

    verdicts = Judge(backend, cache_dir=tmp_path, progress=True).judge(items)
    assert "3/3" in capsys.readouterr().err  # the bar counted every prompt sent
    assert [v.status for v in verdicts] == ["unparseable"] * 3
    assert all(v.verdict is None and v.raw is not None and v.attempts == 1 for v in verdicts)
    table = aggregate(verdicts)
    assert table["KB"].accuracy is None and table["KB"].n_unparseable == 1
    assert table["NI"].n_ok == 0 and table["NI"].n_unparseable == 1

    # Rerun: an answer without a verdict is never cached, so each is asked again (greedy: the same).
    calls = []
    generate = backend.generate
    monkeypatch.setattr(backend, "generate", lambda msgs: calls.append(1) or generate(msgs))
    again = Judge(backend, cache_dir=tmp_path, progress=True).judge(items)
    assert len(calls) == 3 and not any(v.cached for v in again)
    assert [v.raw for v in again] == [v.raw for v in verdicts]


def test_hf_judge_greedy_is_deterministic(tiny_judge):
    model, tok = tiny_judge
    backend = HFBackend(model, tok, model_id="tiny", max_new_tokens=6)
    msgs = [{"role": "system", "content": "Judge."}, {"role": "user", "content": "Reply: arr"}]
    assert backend.generate(msgs) == backend.generate(msgs)


def test_hf_judge_failure_is_counted(tiny_judge, monkeypatch):
    model, tok = tiny_judge
    backend = HFBackend(model, tok, model_id="tiny", max_new_tokens=4)

    def too_long(messages):
        raise ValueError("prompt longer than the context")

    monkeypatch.setattr(backend, "generate", too_long)
    items = judge_items(
        [{"task": "role_related_mrc_refused_no_narration", "question": [{"role": "User", "content": "x"}]}], ["y"]
    )
    (v,) = Judge(backend, cache_dir=None).judge(items)
    assert (v.status, v.verdict) == ("failed", None) and "context" in v.error
    assert aggregate([v])["RS"].n_failed == 1
