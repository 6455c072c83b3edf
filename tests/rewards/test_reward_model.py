"""The ``reward_model`` reward: a tiny sequence-classification model built from config and saved as
a local folder scores each conversation as the model itself does when called on it directly (one
unpadded conversation at a time), whatever the batch size, with TRL's rendering of prompt + reply."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

from rolemrc.errors import InputNotFound
from rolemrc.rewards import RewardModelReward, build_rewards
from rolemrc import asset as asset_path

PROMPTS = [
    [{"role": "system", "content": "You are Ada, a lighthouse keeper."}, {"role": "user", "content": "Any storms?"}],
    [{"role": "user", "content": "Hello?"}],
    [{"role": "system", "content": "You are Rook."}, {"role": "user", "content": "Status?"},
     {"role": "assistant", "content": "Engines hot."}, {"role": "user", "content": "And the hull?"}],
]
REPLIES = ["Aye, a gale rolled in at dawn and the lamp held steady all night long.", "Hi.", "Holding, barely."]


def _save_tiny_rm(folder, num_labels: int = 1) -> None:
    tok = AutoTokenizer.from_pretrained(asset_path("tokenizers/tiny-llama3"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      num_labels=num_labels, pad_token_id=tok.pad_token_id,
                      id2label={i: f"l{i}" for i in range(num_labels)}, label2id={f"l{i}": i for i in range(num_labels)})
    LlamaForSequenceClassification(cfg).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rm")
    _save_tiny_rm(folder)
    return folder


def _direct(folder, prompt, reply, label: int = 0) -> float:
    tok = AutoTokenizer.from_pretrained(folder)
    model = LlamaForSequenceClassification.from_pretrained(folder).eval()
    text = tok.apply_chat_template([*prompt, {"role": "assistant", "content": reply}], tokenize=False)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids).logits[0, label].item()


@pytest.mark.parametrize("batch_size", [1, 2, 8])
def test_scores_equal_calling_the_model_directly(rm_dir, batch_size):
    rs = build_rewards({"rm": {"type": "reward_model", "path": str(rm_dir), "batch_size": batch_size,
                               "device": "cpu", "weight": 0.5}})
    completions = [[{"role": "assistant", "content": r}] for r in REPLIES]  # TRL's conversational form too
    out = rs(PROMPTS, completions)
    want = torch.tensor([_direct(rm_dir, p, r) for p, r in zip(PROMPTS, REPLIES)], dtype=torch.float64)
    torch.testing.assert_close(out.per_reward[:, 0], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.rewards, 0.5 * want, atol=1e-5, rtol=1e-5)
    assert len(set(want.tolist())) == 3  # the replies are told apart: a real score, not a constant
    assert out.metrics["rewards/rm/mean"] == pytest.approx(want.mean().item(), abs=1e-5)


def test_renders_as_trl_does(rm_dir):
    data_utils = pytest.importorskip("trl.data_utils")
    rm = RewardModelReward(str(rm_dir), device="cpu")
    for p, r in zip(PROMPTS, REPLIES):
        msgs = [*p, {"role": "assistant", "content": r}]
        assert rm.render(p, r) == data_utils.apply_chat_template({"messages": msgs}, rm.tokenizer)["text"]


def test_label_choice_and_dtype(tmp_path):
    _save_tiny_rm(tmp_path, num_labels=3)
    with pytest.raises(ValueError, match=r"rewards.rm: .* has 3 labels; set rewards.rm.label"):
        build_rewards({"rm": {"type": "reward_model", "path": str(tmp_path)}})
    by_name = RewardModelReward(str(tmp_path), label="l2", device="cpu")
    by_index = RewardModelReward(str(tmp_path), label=2, device="cpu", dtype="bfloat16")
    assert by_index.model.dtype == torch.bfloat16
    got = by_name(prompts=PROMPTS[:1], completions=REPLIES[:1])
    assert got[0] == pytest.approx(_direct(tmp_path, PROMPTS[0], REPLIES[0], label=2), abs=1e-5)
    assert by_index(prompts=PROMPTS[:1], completions=REPLIES[:1])[0] == pytest.approx(got[0], abs=0.1)
    with pytest.raises(ValueError, match=r"label=5 is out of range"):
        RewardModelReward(str(tmp_path), label=5)
    with pytest.raises(ValueError, match=r"label='nope' is not one of"):
        RewardModelReward(str(tmp_path), label="nope")


@pytest.mark.parametrize("spec,error,match", [
    ({"type": "reward_model"}, ValueError, r"rewards.rm.path is required"),
    ({"type": "reward_model", "path": "/no/such/rm"}, InputNotFound, r"rewards.rm.path=/no/such/rm: no such folder"),
    ({"type": "reward_model", "path": "x", "batchsize": 4}, ValueError, r"unknown key\(s\) rewards.rm.batchsize"),
    ({"type": "reward_model", "path": "RM", "dtype": "int8"}, ValueError, r"rewards.rm.dtype: unknown"),
    ({"type": "reward_model", "path": "RM", "batch_size": 0}, ValueError, r"rewards.rm.batch_size must be >= 1"),
])
def test_bad_specs_name_the_key(rm_dir, spec, error, match):
    spec = {k: str(rm_dir) if v == "RM" else v for k, v in spec.items()}
    with pytest.raises(error, match=match):
        build_rewards({"rm": spec})


def test_a_folder_that_is_no_classifier_is_named(tmp_path):
    AutoTokenizer.from_pretrained(asset_path("tokenizers/tiny-llama3")).save_pretrained(tmp_path)
    with pytest.raises(OSError, match=r"^rewards.rm.path=.*: the folder has no model files \(no config.json\): point "
                                      r"rewards.rm.path at a model's folder or a hub id$"):
        build_rewards({"rm": {"type": "reward_model", "path": str(tmp_path)}})
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')  # a config, no weights
    with pytest.raises(OSError, match=r"rewards.rm.path=.*cannot load it as a sequence-classification model"):
        build_rewards({"rm": {"type": "reward_model", "path": str(tmp_path)}})
