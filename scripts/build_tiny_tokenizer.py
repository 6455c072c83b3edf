"""Build the tiny byte-level BPE tokenizers shipped in ``rolemrc/assets/tokenizers``.

    .venv/bin/python scripts/build_tiny_tokenizer.py

One vocabulary (trained on the shipped sample data), saved twice with different chat
templates: ``tiny-llama3`` renders the exact Llama-3.1 token layout, ``tiny-chatml`` the
Qwen2.5 (ChatML) layout. Tests and ``model=tiny`` use them; real runs use the model's own
tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ASSETS = Path(__file__).resolve().parents[1] / "src" / "rolemrc" / "assets"
VOCAB_SIZE = 2048
SPECIAL = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|pad|>",
]


def corpus() -> list[str]:
    texts: list[str] = []
    for path in sorted((ASSETS / "sample").glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            stack = [record]
            while stack:  # every string anywhere in the record
                item = stack.pop()
                if isinstance(item, str):
                    texts.append(item)
                elif isinstance(item, dict):
                    stack.extend(item.values())
                elif isinstance(item, list):
                    stack.extend(item)
    texts += ["system", "user", "assistant", "You are a helpful assistant."]
    return texts


def main() -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    layouts = {
        "tiny-llama3": dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", template="llama3.jinja"),
        "tiny-chatml": dict(bos_token=None, eos_token="<|im_end|>", template="chatml.jinja"),
    }
    for name, spec in layouts.items():
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token=spec["bos_token"], eos_token=spec["eos_token"],
            pad_token="<|pad|>", unk_token=None, clean_up_tokenization_spaces=False,
        )
        fast.chat_template = (ASSETS / "templates" / spec["template"]).read_text()
        out = ASSETS / "tokenizers" / name
        fast.save_pretrained(out)
        print(f"saved {out} (vocab {len(fast)})")


if __name__ == "__main__":
    main()
