"""Preference training throughput (pairs per second) on RoleMRC-shaped pairs (long prompt, short
replies), one contender per process: DPO (``--objective dpo``, the default), the reference-free
SimPO and ORPO (``--objective simpo|orpo``) against TRL's CPOTrainer (``loss_type=simpo``) and
ORPOTrainer, KTO (``--objective kto``) against KTOTrainer and the reward model
(``--objective reward``) against RewardTrainer:

    .venv/bin/python benchmarks/dpo_throughput.py --work <dir> --contender ours           # share_prompt, copy reference
    .venv/bin/python benchmarks/dpo_throughput.py --work <dir> --contender ours_pre       # share_prompt, reference=precomputed
    .venv/bin/python benchmarks/dpo_throughput.py --work <dir> --contender ours_separate  # share_prompt=false
    .venv/bin/python benchmarks/dpo_throughput.py --work <dir> --contender trl            # TRL DPOTrainer, its defaults
    .venv/bin/python benchmarks/dpo_throughput.py --work <dir> --contender trl_no_gc      # ... gradient_checkpointing=False
    .venv/bin/python benchmarks/dpo_throughput.py --work <dir> --contender trl_pre_no_gc  # ... + precompute_ref_log_probs

    .venv/bin/python benchmarks/dpo_throughput.py --work <dir> --objective simpo --contender ours       # objective=simpo
    .venv/bin/python benchmarks/dpo_throughput.py --work <dir> --objective simpo --contender trl        # CPOTrainer, its defaults
    .venv/bin/python benchmarks/dpo_throughput.py --work <dir> --objective orpo --contender trl_no_gc   # ORPOTrainer, no checkpointing
    .venv/bin/python benchmarks/dpo_throughput.py --work <dir> --objective kto --contender trl          # KTOTrainer, its defaults
    .venv/bin/python benchmarks/dpo_throughput.py --work <dir> --objective reward --contender ours      # objective=reward

``<dir>`` is prepared by ``benchmarks/run_all.py``. Every contender: the same model and the same
``dpo_pairs_used`` pairs (exactly one pass), ``dpo_batch`` pairs per optimizer step, sigmoid loss,
beta 0.1, the spec's precision (fp32 by default), max length 3000 (prompt cut to 3/4 of it, the
paper's recipe).

- ours: ``objective.share_prompt=true``: prompt, chosen and rejected in one sequence, the prompt
  encoded once for policy and reference; lm_head only at the reply tokens; a frozen copy of the
  starting model as the reference (``objective.reference=copy``, TRL's default).
- ours_pre: the same with ``objective.reference=precomputed`` (one reference pass before training).
- ours_separate: chosen and rejected as two padded rows (what sharing the prompt alone buys).
- trl: ``DPOTrainer`` with ``DPOConfig`` defaults (gradient checkpointing, chosen and rejected
  concatenated into one padded batch, reference model loaded as a second copy), except
  ``max_length`` (the default 1024 would cut RoleMRC prompts), precision, batch size, run length.
- trl_no_gc: ``gradient_checkpointing=False``. trl_pre_no_gc: also ``precompute_ref_log_probs=True``
  (no reference model kept during training). TRL 1.16 disables ``padding_free`` for DPO.

SimPO and ORPO (reference-free: no reference model, no reference pass): ours is
``objective=simpo|orpo`` at its defaults (chosen and rejected as padded rows; ORPO's NLL over prompt
+ response, as TRL); trl is ``CPOTrainer``/``ORPOTrainer`` at ``CPOConfig``/``ORPOConfig`` defaults
(gradient checkpointing on) and trl_no_gc without checkpointing (their fastest setting here: neither
has padding-free or prompt sharing), both with the loss settings of ours so the objective is the
same (SimPO: ``beta`` 2.0, ``simpo_gamma`` 1.0, ``cpo_alpha`` 0 where CPOConfig's default is 1.0;
ORPO: ``beta`` 0.1, TRL's default).

KTO and the reward model: ours is ``objective=kto|reward`` at its defaults; trl is ``KTOTrainer`` /
``RewardTrainer`` at ``KTOConfig`` / ``RewardConfig`` defaults (gradient checkpointing on) and
trl_no_gc without checkpointing. KTO (loss_type kto, beta 0.1, both sides' defaults, a frozen copy
of the model as the reference on both): each pair is a desirable (chosen) and an undesirable
(rejected) example, ours splitting ``data.pairs`` itself, TRL given the same examples unpaired in
the same order (a micro-batch's chosen examples, then its rejected ones), ``2 x dpo_batch`` examples
per step; both score the mismatched KL rows with the policy and the reference. The reward model:
a one-logit sequence-classification head on the same weights (TRL: ``AutoModelForSequenceClassification``,
ours: objective=reward's own head), Bradley-Terry loss, no centring, chosen and rejected as rows.

Precomputed references: the pass over the used pairs is timed separately (``precompute_s``) and
``pairs_per_s`` charges it per pair (``timed pairs / (timed seconds + precompute_s x timed
share)``): a real epoch pays it once per pair, like the inline reference forward of the others.
``pairs_per_s_steps_only`` leaves it out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (FlopSpan, Spec, hf_timer, lightning_timer, rolemrc_overrides, run_rolemrc, set_env,  # noqa: E402
                    trl_args, trl_pairs, write_result)

set_env()


def run_ours(work: Path, spec: Spec, contender: str, objective: str = "dpo") -> dict:
    timer = lightning_timer()
    share_prompt = contender != "ours_separate"
    reference = "precomputed" if contender == "ours_pre" else "copy"
    if objective == "dpo":
        chosen_objective = ["objective=dpo", f"objective.reference={reference}",
                            f"objective.share_prompt={str(share_prompt).lower()}"]
    else:  # the objective's defaults (conf/objective/<name>.yaml)
        reference = "copy" if objective == "kto" else "none"
        chosen_objective = [f"objective={objective}"]
    overrides = rolemrc_overrides(work, spec, chosen_objective, [
        f"data.pairs=[{{path:{work / 'pairs_used.jsonl'}}}]", f"data.max_length={spec.dpo_max_length}",
        f"data.max_prompt_length={spec.dpo_max_prompt_length}", f"data.batch_size={spec.dpo_batch}"])
    run_rolemrc(overrides, timer)
    return {"contender": contender, "objective": objective, "reference": reference, "batch_size": spec.dpo_batch,
            "overrides": overrides,
            "precompute_s": timer.precompute_seconds() if reference == "precomputed" else 0.0,
            "precompute_flops": timer.precompute_flops if reference == "precomputed" else 0.0,
            **timer.steps.summary(spec.warmup)}


TRL_VARIANTS = {  # contender -> DPOConfig overrides on top of TRL's defaults
    "trl": {},
    "trl_no_gc": {"gradient_checkpointing": False},
    "trl_pre_no_gc": {"gradient_checkpointing": False, "precompute_ref_log_probs": True},
}


# --objective simpo|orpo|kto|reward: the peer trainer, and the loss settings that make its objective
# ours (conf/objective/<name>.yaml; KTO's and the reward model's are TRL's defaults); the training
# settings stay the trainer's defaults.
PEERS = {
    "simpo": ("trl.experimental.cpo", "CPOConfig", "CPOTrainer",
              {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 1.0, "cpo_alpha": 0.0, "label_smoothing": 0.0}),
    "orpo": ("trl.experimental.orpo", "ORPOConfig", "ORPOTrainer", {"beta": 0.1}),
    "kto": ("trl", "KTOConfig", "KTOTrainer", {"loss_type": "kto", "beta": 0.1}),
    "reward": ("trl", "RewardConfig", "RewardTrainer", {"center_rewards_coefficient": None}),
}
PEER_VARIANTS = {"trl": {}, "trl_no_gc": {"gradient_checkpointing": False}}


def kto_examples(work: Path, spec: Spec) -> list[dict]:
    """The used pairs as TRL's unpaired examples in ours' order: each micro-batch of ``dpo_batch``
    pairs gives its chosen (desirable) examples, then its rejected ones (KTOTrainer samples in order)."""
    pairs = trl_pairs(work)
    out: list[dict] = []
    for start in range(0, len(pairs), spec.dpo_batch):
        chunk = pairs[start : start + spec.dpo_batch]
        out += [{"prompt": r["prompt"], "completion": r["chosen"], "label": True} for r in chunk]
        out += [{"prompt": r["prompt"], "completion": r["rejected"], "label": False} for r in chunk]
    return out


def run_trl_peer(work: Path, spec: Spec, contender: str, objective: str) -> dict:
    """TRL's CPOTrainer (loss_type=simpo), ORPOTrainer (no reference model), KTOTrainer (its reference)
    or RewardTrainer (a one-logit sequence-classification model of the same weights)."""
    import importlib
    import warnings

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    module, config_name, trainer_name, loss = PEERS[objective]
    with warnings.catch_warnings():  # trl.experimental warns on import that its API may change
        warnings.simplefilter("ignore")
        mod = importlib.import_module(module)
    config_class, trainer_class = getattr(mod, config_name), getattr(mod, trainer_name)
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    if objective == "reward":
        model = AutoModelForSequenceClassification.from_pretrained(work / "model", num_labels=1)
    else:
        model = AutoModelForCausalLM.from_pretrained(work / "model")
    timer = hf_timer(model, pairs=True)  # KTO: a pair's two examples are two rows, as ours
    records = kto_examples(work, spec) if objective == "kto" else trl_pairs(work)
    batch = 2 * spec.dpo_batch if objective == "kto" else spec.dpo_batch  # KTO's batch counts examples
    with tempfile.TemporaryDirectory() as tmp:
        args = trl_args(config_class, spec, tmp, batch, max_length=spec.dpo_max_length, **loss,
                        **PEER_VARIANTS[contender])
        trainer = trainer_class(model=model, args=args, train_dataset=Dataset.from_list(records),
                                processing_class=tokenizer, callbacks=[timer])
        settings = {k: getattr(args, k) for k in ("bf16", "gradient_checkpointing", "per_device_train_batch_size",
                                                  "max_length", *loss)}
        reference = "separate model copy" if getattr(trainer, "ref_model", None) is not None else "none"
        trainer.train()
    return {"contender": contender, "objective": objective, "trainer": trainer_name, "reference": reference,
            "config": {k: str(v) for k, v in settings.items()}, "precompute_s": 0.0, "precompute_flops": 0.0,
            **timer.steps.summary(spec.warmup)}


def run_trl(work: Path, spec: Spec, contender: str) -> dict:
    import time

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    records = trl_pairs(work)
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model")
    timer = hf_timer(model, pairs=True)
    precompute = [0.0, 0.0]  # seconds, FLOPs
    original = DPOTrainer._precompute_ref_logps

    def timed_precompute(self, *a, **k):  # noqa: ANN001, ANN002, ANN003
        span = FlopSpan()
        span.start()
        start = time.perf_counter()
        try:
            return original(self, *a, **k)
        finally:
            precompute[0] += time.perf_counter() - start
            precompute[1] += span.stop()

    DPOTrainer._precompute_ref_logps = timed_precompute
    overrides = TRL_VARIANTS[contender]
    with tempfile.TemporaryDirectory() as tmp:
        args = trl_args(DPOConfig, spec, tmp, spec.dpo_batch, max_length=spec.dpo_max_length, **overrides)
        trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(records),
                             processing_class=tokenizer, callbacks=[timer])
        defaults = {k: getattr(args, k) for k in ("bf16", "gradient_checkpointing", "padding_free",
                                                  "precompute_ref_log_probs", "loss_type", "beta",
                                                  "per_device_train_batch_size", "max_length")}
        defaults["reference"] = ("separate model copy" if trainer.ref_model is not None
                                 else "precomputed" if args.precompute_ref_log_probs else "adapter/none")
        trainer.train()
    return {"contender": contender, "config": {k: str(v) for k, v in defaults.items()},
            "precompute_s": round(precompute[0], 3), "precompute_flops": precompute[1],
            **timer.steps.summary(spec.warmup)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--objective", choices=["dpo", *PEERS], default="dpo")
    p.add_argument("--contender", choices=["ours", "ours_pre", "ours_separate", *TRL_VARIANTS], required=True)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    spec = Spec.load(args.work)
    if args.objective != "dpo" and args.contender not in ("ours", *PEER_VARIANTS):
        p.error(f"--objective {args.objective}: contenders are ours, {', '.join(PEER_VARIANTS)}")
    if args.objective != "dpo" and args.contender.startswith("trl"):
        result = run_trl_peer(args.work, spec, args.contender, args.objective)
    elif args.contender.startswith("trl"):
        result = run_trl(args.work, spec, args.contender)
    else:
        result = run_ours(args.work, spec, args.contender, args.objective)
    result["command"] = "python " + " ".join([f"benchmarks/{Path(__file__).name}", *sys.argv[1:]])
    steps_only = result.pop("samples_per_s")
    share = result["samples"] / spec.dpo_pairs_used  # the timed pairs' part of the precompute pass
    result["pairs_per_s_steps_only"] = round(steps_only, 4)
    result["pairs_per_s"] = round(result["samples"] / (result["seconds"] + result["precompute_s"] * share), 4)
    # FLOPs charged like time: the timed steps plus their pairs' share of a precomputed reference pass.
    charged = result["flops"] + result["precompute_flops"] * share
    result["flops_per_pair"] = charged / result["samples"]
    result["flop_per_s"] = charged / (result["seconds"] + result["precompute_s"] * share)
    result["tokens_per_s"] = round(result["tokens_per_s"], 2)
    write_result(args.out or args.work / "results" / f"{args.objective}_{args.contender}.json", result)


if __name__ == "__main__":
    main()
