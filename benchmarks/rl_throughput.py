"""Online RL step throughput (completions per second, rollout included) with rollouts of a fixed
length, one contender per process: GRPO (``--objective grpo``) against TRL's GRPOTrainer and RLOO
(``--objective rloo``) against its RLOOTrainer:

    .venv/bin/python benchmarks/rl_throughput.py --work <dir> --objective grpo --contender ours       # objective=grpo
    .venv/bin/python benchmarks/rl_throughput.py --work <dir> --objective grpo --contender trl        # GRPOTrainer, its defaults
    .venv/bin/python benchmarks/rl_throughput.py --work <dir> --objective grpo --contender trl_no_gc  # ... no checkpointing
    .venv/bin/python benchmarks/rl_throughput.py --work <dir> --objective rloo --contender ours       # objective=rloo

``<dir>`` is prepared by ``benchmarks/run_all.py``. Every contender, per optimizer step: the same
``rl_prompts`` prompts' worth of the spec's data (``prompts_used.jsonl``: the pairs' prompts,
exactly one pass, each side shuffling its own way), each sampled ``num_generations`` times with
transformers ``generate`` (KV cache, temperature 1, top-p 1, top-k off), every completion exactly
``completion_length`` tokens (``min_new_tokens`` = ``max_new_tokens``: the stop tokens are
suppressed until then, so no completion ends early and both sides train the same number of
tokens), scored by the same cheap text reward (:func:`text_reward`: distinct words over words), one
optimizer step per rollout (``num_iterations`` 1), the spec's precision.

- ours: ``objective=grpo|rloo`` at its defaults (GRPO: loss_type dapo, beta 0, no reference model;
  RLOO: beta 0.05, a frozen copy as the reference) with ``num_generations``,
  ``max_completion_length`` and the reward set; ``data.batch_size`` = ``rl_prompts`` prompts. rolemrc
  has no ``min_new_tokens`` key: this benchmark adds it to the ``generate`` call (``Sampling.hf``).
- trl: ``GRPOTrainer``/``RLOOTrainer`` with ``GRPOConfig``/``RLOOConfig`` defaults (gradient
  checkpointing on; GRPO: loss_type dapo, beta 0; RLOO: beta 0.05, its reference model) except
  ``num_generations``, ``max_completion_length``, ``generation_kwargs={"min_new_tokens": ...}``,
  ``per_device_train_batch_size`` = ``rl_prompts x num_generations`` completions (one generation
  batch per step, TRL's default ``steps_per_generation``), precision and run length.
- trl_no_gc: the same with ``gradient_checkpointing=False`` (the faster on this CPU).

FLOPs (FlopCounterMode) cover the whole step: the rollout's prefill and decoding, the reference
forward where there is one, the policy's forward and backward.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (Spec, hf_timer, lightning_timer, rolemrc_overrides, run_rolemrc, set_env,  # noqa: E402
                    trl_args, trl_messages, write_result)

set_env()

OBJECTIVES = {"grpo": ("GRPOConfig", "GRPOTrainer"), "rloo": ("RLOOConfig", "RLOOTrainer")}
TRL_VARIANTS = {"trl": {}, "trl_no_gc": {"gradient_checkpointing": False}}


def text_reward(prompts: list, completions: list, **kwargs: object) -> list[float]:
    """Distinct words over words of each completion: cheap, the same on both sides (rolemrc passes
    texts, TRL assistant messages), and varied enough that advantages are not all zero."""
    from rolemrc.rewards import completion_texts

    words = [text.split() for text in completion_texts(completions)]
    return [len(set(w)) / max(len(w), 1) for w in words]


def fixed_length_generation() -> None:
    """rolemrc's sampled ``generate`` calls with ``min_new_tokens`` = ``max_new_tokens`` (TRL's side
    gets the same through ``generation_kwargs``)."""
    from rolemrc.rollout.engine import Sampling

    original = Sampling.hf

    def hf(self: Sampling) -> dict:
        kwargs = original(self)
        return {**kwargs, "min_new_tokens": self.max_new_tokens} if self.sample else kwargs

    Sampling.hf = hf


def run_ours(work: Path, spec: Spec, objective: str) -> dict:
    fixed_length_generation()
    timer = lightning_timer()
    overrides = rolemrc_overrides(work, spec, [
        f"objective={objective}", f"objective.num_generations={spec.num_generations}",
        f"objective.max_completion_length={spec.completion_length}",
        "~objective.rewards.verifier", "+objective.rewards.bench._target_=__main__.text_reward",
    ], [f"data.prompts=[{{path:{work / 'prompts_used.jsonl'}}}]", f"data.max_length={spec.dpo_max_length}",
        f"data.max_prompt_length={spec.dpo_max_prompt_length}", f"data.batch_size={spec.rl_prompts}"])
    run_rolemrc(overrides, timer)
    return {"contender": "ours", "objective": objective, "overrides": overrides, **timer.steps.summary(spec.warmup)}


def run_trl(work: Path, spec: Spec, contender: str, objective: str) -> dict:
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config_class, trainer_class = (getattr(trl, name) for name in OBJECTIVES[objective])
    records = [{"prompt": trl_messages(json.loads(line)["prompt"])}
               for line in (work / "prompts_used.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model")
    timer = hf_timer(model, pairs=False)
    with tempfile.TemporaryDirectory() as tmp:
        args = trl_args(config_class, spec, tmp, spec.rl_prompts * spec.num_generations,
                        num_generations=spec.num_generations, max_completion_length=spec.completion_length,
                        generation_kwargs={"min_new_tokens": spec.completion_length}, **TRL_VARIANTS[contender])
        trainer = trainer_class(model=model, reward_funcs=[text_reward], args=args,
                                train_dataset=Dataset.from_list(records), processing_class=tokenizer, callbacks=[timer])
        settings = {k: getattr(args, k) for k in (
            "bf16", "gradient_checkpointing", "per_device_train_batch_size", "num_generations", "max_completion_length",
            "generation_kwargs", "steps_per_generation", "num_iterations", "beta", "temperature", "top_p", "top_k",
            *(("loss_type", "scale_rewards") if objective == "grpo" else ()))}
        reference = "separate model copy" if getattr(trainer, "ref_model", None) is not None else "none"
        trainer.train()
    return {"contender": contender, "objective": objective, "trainer": trainer_class.__name__, "reference": reference,
            "config": {k: str(v) for k, v in settings.items()}, **timer.steps.summary(spec.warmup)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--objective", choices=list(OBJECTIVES), default="grpo")
    p.add_argument("--contender", choices=["ours", *TRL_VARIANTS], required=True)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    spec = Spec.load(args.work)
    if args.contender.startswith("trl"):
        result = run_trl(args.work, spec, args.contender, args.objective)
    else:
        result = run_ours(args.work, spec, args.objective)
    result["command"] = "python " + " ".join([f"benchmarks/{Path(__file__).name}", *sys.argv[1:]])
    # Every completion is completion_length tokens: a step trains rl_prompts x num_generations of them.
    per_step = spec.rl_prompts * spec.num_generations
    result.update({"completions": result["steps"] * per_step, "completion_length": spec.completion_length,
                   "num_generations": spec.num_generations, "prompts_per_step": spec.rl_prompts})
    result["completions_per_s"] = round(result["completions"] / result["seconds"], 4)
    result["flops_per_completion"] = result["flops"] / result["completions"]
    result["flop_per_s"] = result["flops"] / result["seconds"]
    result["tokens_per_s"] = round(result["tokens_per_s"], 2)
    write_result(args.out or args.work / "results" / f"{args.objective}_{args.contender}.json", result)


if __name__ == "__main__":
    main()
