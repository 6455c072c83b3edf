"""DPO training throughput (preference pairs per second) on RoleMRC-shaped pairs (long prompt,
short replies), one contender per process:

    .venv/bin/python benchmarks/dpo_throughput.py --work <dir> --contender ours           # share_prompt=true
    .venv/bin/python benchmarks/dpo_throughput.py --work <dir> --contender ours_separate  # share_prompt=false
    .venv/bin/python benchmarks/dpo_throughput.py --work <dir> --contender trl            # TRL DPOTrainer, its defaults
    .venv/bin/python benchmarks/dpo_throughput.py --work <dir> --contender trl_no_gc      # ... without gradient checkpointing

``<dir>`` is prepared by ``benchmarks/run_all.py``. Every contender: the same model and pairs,
``dpo_batch`` pairs per optimizer step (equal batch composition), a frozen copy of the starting
model as the reference (TRL's default, ``objective.reference=copy`` here), sigmoid loss, beta 0.1,
bf16 mixed precision, max length 3000 (prompt cut to 3/4 of it, the paper's recipe).

- ours: ``objective.share_prompt=true``: prompt, chosen and rejected in one sequence, the prompt
  encoded once for policy and reference; lm_head only at the reply tokens.
- ours_separate: the same pipeline with chosen and rejected as two padded rows (shows what
  sharing the prompt alone buys).
- trl: ``DPOTrainer`` with ``DPOConfig`` defaults (bf16, gradient checkpointing, chosen and
  rejected concatenated into one padded batch, reference model loaded as a second copy, fused
  lm_head), except ``max_length`` (the default 1024 would cut RoleMRC prompts), the batch size and
  the run length.
- trl_no_gc (not in ``make bench``): the same with ``gradient_checkpointing=False``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Spec, compose, hf_timer, lightning_timer, set_env, write_result  # noqa: E402

set_env()


def run_ours(work: Path, spec: Spec, share_prompt: bool) -> dict:
    from rolemrc import train as train_module

    timer = lightning_timer()
    overrides = [
        f"model.path={work / 'model'}", "model.name=bench", "objective=dpo", "objective.reference=copy",
        f"objective.share_prompt={str(share_prompt).lower()}", f"data.pairs=[{{path:{work / 'pairs.jsonl'}}}]",
        "data.val_fraction=0", f"data.max_length={spec.dpo_max_length}",
        f"data.max_prompt_length={spec.dpo_max_prompt_length}", f"data.batch_size={spec.dpo_batch}",
        "trainer.precision=bf16-mixed", f"trainer.max_steps={spec.warmup + spec.steps}",
        "trainer.enable_progress_bar=false", "logger=none", "callbacks=none", "export.enabled=false",
        f"seed={spec.seed}",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose(overrides, Path(tmp))
        original_build = train_module.build_callbacks
        train_module.build_callbacks = lambda c: [*original_build(c), timer]
        train_module.run(cfg)
    name = "ours" if share_prompt else "ours_separate"
    return {"contender": name, "batch_size": spec.dpo_batch, "overrides": overrides,
            **timer.steps.summary(spec.warmup)}


def run_trl(work: Path, spec: Spec, checkpointing: bool = True) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    records = []
    for line in (work / "pairs.jsonl").read_text().splitlines():
        r = json.loads(line)
        prompt = [{"role": m["role"].lower(), "content": m["content"]} for m in r["prompt"]]
        records.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": r["chosen"]}],
                        "rejected": [{"role": "assistant", "content": r["rejected"]}]})
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model")
    timer = hf_timer(model, pairs=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(output_dir=tmp, max_length=spec.dpo_max_length, per_device_train_batch_size=spec.dpo_batch,
                         max_steps=spec.warmup + spec.steps, report_to="none", save_strategy="no", seed=spec.seed,
                         disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
                         **({} if checkpointing else {"gradient_checkpointing": False}))
        trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(records),
                             processing_class=tokenizer, callbacks=[timer])
        defaults = {k: getattr(args, k) for k in ("bf16", "gradient_checkpointing", "padding_free",
                                                  "precompute_ref_log_probs", "loss_type", "beta",
                                                  "per_device_train_batch_size", "max_length")}
        defaults["reference"] = "separate model copy" if trainer.ref_model is not None else "adapter/none"
        trainer.train()
    return {"contender": "trl" if checkpointing else "trl_no_gc", "config": {k: str(v) for k, v in defaults.items()},
            **timer.steps.summary(spec.warmup)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--contender", choices=["ours", "ours_separate", "trl", "trl_no_gc"], required=True)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    spec = Spec.load(args.work)
    if args.contender.startswith("trl"):
        result = run_trl(args.work, spec, checkpointing=args.contender == "trl")
    else:
        result = run_ours(args.work, spec, share_prompt=args.contender == "ours")
    result["command"] = "python " + " ".join([f"benchmarks/{Path(__file__).name}", *sys.argv[1:]])
    result["pairs_per_s"] = round(result.pop("samples_per_s"), 4)
    result["tokens_per_s"] = round(result["tokens_per_s"], 2)
    write_result(args.out or args.work / "results" / f"dpo_{args.contender}.json", result)


if __name__ == "__main__":
    main()
