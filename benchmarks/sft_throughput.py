"""SFT training throughput (non-padding tokens per second) on RoleMRC-shaped data, one contender
per process:

    .venv/bin/python benchmarks/sft_throughput.py --work <dir> --contender ours            # rolemrc, data.packing=true
    .venv/bin/python benchmarks/sft_throughput.py --work <dir> --contender pad_max         # rolemrc, rows padded to max_length (paper)
    .venv/bin/python benchmarks/sft_throughput.py --work <dir> --contender trl             # TRL SFTTrainer, its defaults
    .venv/bin/python benchmarks/sft_throughput.py --work <dir> --contender trl_no_gc       # ... gradient_checkpointing=False
    .venv/bin/python benchmarks/sft_throughput.py --work <dir> --contender trl_pack        # ... packing=True (BFD, padding-free)
    .venv/bin/python benchmarks/sft_throughput.py --work <dir> --contender trl_pack_no_gc  # ... packing, no checkpointing
    .venv/bin/python benchmarks/sft_throughput.py --work <dir> --contender trl_padfree_no_gc  # padding_free=True, no packing

``<dir>`` is prepared by ``benchmarks/run_all.py`` (model + data + spec.json). All train the
same model on the same conversations in the spec's precision (fp32 by default, see common.py),
loss on the assistant reply only, with the same allocator settings.

- ours: ``data.packing=true``: conversations packed best-fit into rows of ``max_length`` tokens,
  attention per conversation (no padding, no cross-conversation attention), the lm_head only at
  the reply tokens. ``data.batch_size`` rows per step chosen to hold about ``sft_batch``
  conversations.
- pad_max: the same rolemrc pipeline, one conversation per row, every row padded to
  ``max_length`` (4200, as the paper's recipe did).
- trl: ``SFTTrainer`` with ``SFTConfig`` defaults (bf16, gradient checkpointing, no packing,
  no padding-free, batch padded to its longest row, fused lm_head on the completion tokens
  since the data is prompt-completion), except ``max_length`` (the default 1024 would cut
  RoleMRC prompts, and with them the replies) and the run length.
- trl_no_gc: the same with ``gradient_checkpointing=False`` (faster on CPU when memory allows).
- trl_pack / trl_pack_no_gc: ``packing=True`` (TRL 1.16's best-fit-decreasing packing, which
  turns on padding-free collation: one flattened row, position ids restarting per conversation)
  with the same number of packed rows per step as ours.
- trl_padfree_no_gc: ``padding_free=True`` without packing (each step's conversations flattened).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (Spec, hf_timer, lightning_timer, rolemrc_overrides, run_rolemrc, set_env, trl_args,  # noqa: E402
                    trl_messages, write_result)

set_env()


def run_ours(work: Path, spec: Spec, pad_max: bool, extra_callbacks: tuple = ()) -> dict:
    import torch

    from rolemrc.data.datamodule import ChatDataModule
    from rolemrc.objectives import IGNORE_INDEX

    timer = lightning_timer()
    if pad_max:
        batch_size = spec.sft_batch
        original = ChatDataModule.collator

        def padded_collator(self):  # every row padded to max_length, as in the paper's recipe
            inner = original(self)
            length = self.cfg.max_length

            def collate(examples):
                batch = inner(examples)
                fill = {"input_ids": self.chat.tokenizer.pad_token_id, "labels": IGNORE_INDEX, "attention_mask": 0}
                for key, value in fill.items():
                    extra = length - batch[key].shape[1]
                    batch[key] = torch.nn.functional.pad(batch[key], (0, extra), value=value)
                return batch

            return collate

        ChatDataModule.collator = padded_collator
    else:  # rows per step holding about spec.sft_batch conversations, as the others' batches
        batch_size = packed_rows_per_step(work, spec)
    overrides = rolemrc_overrides(work, spec, ["objective=sft"], [
        f"data.sft=[{{path:{work / 'sft.jsonl'}}}]", f"data.max_length={spec.sft_max_length}",
        f"data.batch_size={batch_size}", f"data.packing={str(not pad_max).lower()}"])
    run_rolemrc(overrides, timer, *extra_callbacks)
    name = "pad_max" if pad_max else "ours"
    return {"contender": name, "batch_size": batch_size, "overrides": overrides, **timer.steps.summary(spec.warmup)}


def _lengths(work: Path) -> list[int]:
    from transformers import AutoTokenizer

    from rolemrc.data.readers import read_examples
    from rolemrc.data.templates import ChatFormat

    chat = ChatFormat(AutoTokenizer.from_pretrained(work / "model"))
    examples, _ = read_examples([{"path": str(work / "sft.jsonl"), "weight": 1.0}], "sft", "raise", 0)
    return [len(chat.encode_conversation(ex.messages).input_ids) for ex in examples]


def packed_rows_per_step(work: Path, spec: Spec) -> int:
    """Rows of ``max_length`` per step holding about ``sft_batch`` conversations (ours and TRL's packing)."""
    from rolemrc.data.packing import pack_rows

    rows = [{"input_ids": [0] * n, "labels": [0] * n} for n in _lengths(work)]
    report = pack_rows(rows, spec.sft_max_length)[1]
    return max(1, round(spec.sft_batch / report["items_per_row"]))


TRL_VARIANTS = {  # contender -> SFTConfig overrides on top of TRL's defaults
    "trl": {},
    "trl_no_gc": {"gradient_checkpointing": False},
    "trl_pack": {"packing": True},
    "trl_pack_no_gc": {"packing": True, "gradient_checkpointing": False},
    # TRL refuses max_length with padding-free unpacked batches; every conversation here is shorter
    # than max_length (run_all.py's data), so None truncates nothing.
    "trl_padfree_no_gc": {"padding_free": True, "gradient_checkpointing": False, "max_length": None},
}


def run_trl(work: Path, spec: Spec, contender: str, extra_callbacks: tuple = ()) -> dict:
    import json

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    records = []
    for line in (work / "sft.jsonl").read_text().splitlines():
        conv = trl_messages(json.loads(line)["conversations"])
        records.append({"prompt": conv[:-1], "completion": conv[-1:]})  # loss on the reply, as ours
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model")
    timer = hf_timer(model, pairs=False)
    overrides = TRL_VARIANTS[contender]
    packing = overrides.get("packing", False)
    batch = packed_rows_per_step(work, spec) if packing else spec.sft_batch
    with tempfile.TemporaryDirectory() as tmp:
        args = trl_args(SFTConfig, spec, tmp, batch, **{"max_length": spec.sft_max_length, **overrides})
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(records),
                             processing_class=tokenizer, callbacks=[timer, *extra_callbacks])
        defaults = {k: getattr(args, k) for k in ("bf16", "gradient_checkpointing", "packing", "padding_free",
                                                  "completion_only_loss", "assistant_only_loss", "loss_type",
                                                  "per_device_train_batch_size", "max_length")}
        trainer.train()
    return {"contender": contender, "config": {k: str(v) for k, v in defaults.items()},
            **timer.steps.summary(spec.warmup)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--contender", choices=["ours", "pad_max", *TRL_VARIANTS], required=True)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    spec = Spec.load(args.work)
    if args.contender.startswith("trl"):
        result = run_trl(args.work, spec, args.contender)
    else:
        result = run_ours(args.work, spec, pad_max=args.contender == "pad_max")
    result["command"] = "python " + " ".join([f"benchmarks/{Path(__file__).name}", *sys.argv[1:]])
    result["flops_per_token"] = result["flops"] / result["tokens"]  # per trained (non-padding) token
    result["flop_per_s"] = result["flops"] / result["seconds"]
    result["tokens_per_s"] = round(result["tokens_per_s"], 2)
    result["samples_per_s"] = round(result["samples_per_s"], 4)
    assert math.isfinite(result["tokens_per_s"])
    write_result(args.out or args.work / "results" / f"sft_{args.contender}.json", result)


if __name__ == "__main__":
    main()
