"""Back-of-the-envelope GPU memory per device for a run, checked before anything loads.

    python -m rolemrc.memory                    # the README table (8B models, 80 GB GPUs)
    python -m rolemrc.memory experiment=rolemrc_llama_sft trainer.devices=8   # one config's estimate
    python -m rolemrc.memory experiment=rolemrc_llama_sft --simulate [--json]  # its simulated per-rank peak

``--simulate`` runs one optimizer step of the configured run under fake tensors on fake ranks
(:mod:`rolemrc.memory_sim`) and reports the per-rank peak by category, and whether it fits;
``model.gradient_checkpointing=auto`` decides from that simulation, the formula below being the
fallback; the decision, and the stored simulated peak it reads, are the run's
(:mod:`rolemrc.run.sizing`), which calls the simulator only when no peak of the run's shape is stored.

A training run calls :func:`log_estimate` in its setup, after the config checks and before any
weight loads: it logs the estimate, and warns when it exceeds ``runtime.device_memory_gb``.

The estimate counts: weights, gradients and AdamW states (sharded over the data-parallel
ranks under FSDP, fp32 master weights with a bf16 compute copy), the unsharded bf16 copy of
the layer being computed, activations (all layers, or with activation checkpointing only each
layer's input plus one layer being recomputed), and no [tokens x vocab] logits (rolemrc's
chunked lm_head never builds them). It is an estimate: allocator fragmentation, NCCL buffers
and the CUDA context (~2-5 GB) come on top, so it warns above 90% of the device.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolemrc import ASSETS
from rolemrc.config import (OBJECTIVES, check_train_config, checkpointing_setting, register, source_group, typed,
                            upgrade_train_config)
from rolemrc.entry import entry_point
from rolemrc.models.family import memory_shape

# rolemrc.memory_sim (the simulator: torch-private trackers, the training code it builds with) is
# imported only where a simulation runs (--simulate here; rolemrc.run.sizing on a miss).

log = logging.getLogger(__name__)
GB = 1024**3


def _shipped(name: str) -> dict[str, Any]:
    """The shape of a shipped architecture (``rolemrc/assets/architectures/<name>/config.json``)."""
    return memory_shape(json.loads((ASSETS / "architectures" / name / "config.json").read_text()))


# The two target models' shapes (their published config.json, shipped), for offline estimates.
KNOWN = {"meta-llama/Llama-3.1-8B": _shipped("llama-3.1-8b"), "Qwen/Qwen2.5-7B": _shipped("qwen2.5-7b")}


@dataclass
class Arch:
    h: int
    layers: int
    inter: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool

    @property
    def layer_params(self) -> int:
        kv = self.h // self.heads * self.kv_heads
        return 2 * self.h * self.h + 2 * self.h * kv + 3 * self.h * self.inter + 2 * self.h

    @property
    def params(self) -> int:
        return self.vocab * self.h * (1 if self.tied else 2) + self.layers * self.layer_params + self.h


def arch_of(model_cfg: Any) -> Arch | None:
    """Dimensions from the config (tiny), a local config.json, or the table above."""
    spec: dict[str, Any] | None = None
    if model_cfg.path is None:
        spec = dict(model_cfg.init)
        spec.setdefault("vocab_size", 2048)
    elif model_cfg.path in KNOWN:
        spec = KNOWN[model_cfg.path]
    elif (Path(model_cfg.path) / "config.json").exists():
        spec = json.loads((Path(model_cfg.path) / "config.json").read_text())
    if not spec:
        return None
    shape = memory_shape({"vocab_size": 32000, **spec})
    return Arch(shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"],
                shape["num_attention_heads"], shape["num_key_value_heads"], shape["vocab_size"],
                shape["tie_word_embeddings"])


def estimate_gb(arch: Arch, *, gpus: int, fsdp: bool, tokens_per_device: int, checkpointing: bool,
                cpu_offload: bool = False, dpo_copy: bool = False, lora: bool = False, qlora: bool = False) -> float:
    """Estimated peak GB per device."""
    p = arch.params
    shard = gpus if fsdp else 1
    if lora or qlora:
        weights = p * (0.55 if qlora else 2)  # frozen base: 4-bit (+ quantization constants) or bf16
        states = 0.01 * p * 16  # adapters (~0.5-1% of the weights) with fp32 master + Adam
        transient = 0
    else:
        weights = 0 if cpu_offload else 4 * p / shard  # fp32 master weights
        states = 0 if cpu_offload else 12 * p / shard  # fp32 grads + Adam m and v
        transient = 2 * (2 * arch.layer_params + arch.vocab * arch.h) if fsdp else 2 * p  # bf16 gathered units
    reference = (2 * p / shard) if dpo_copy else 0
    per_token_layer = 2 * (8 * arch.h + 3 * arch.inter)  # bf16 activations kept for backward
    if checkpointing:
        acts = tokens_per_device * (2 * arch.h * arch.layers + per_token_layer)
    else:
        acts = tokens_per_device * per_token_layer * arch.layers
    lm_head_chunk = 4 * 1024 * arch.vocab * 2  # one chunk of fp32 logits and its gradient
    return (weights + states + transient + reference + acts + lm_head_chunk) / GB


def rollout_gb(arch: Arch, *, gpus: int, fsdp: bool, sequences: int, prompt: int, completion: int,
               cpu_offload: bool = False, dpo_copy: bool = False, lora: bool = False) -> float:
    """Estimated peak GB per device of an online objective's rollout (GRPO's ``generate`` of
    ``sequences`` completions at once, no gradient): the weights and AdamW states it finds (no
    gradients: freed at the previous step's end), the bf16 units gathered for a forward, the bf16
    KV cache of ``prompt + completion`` positions (per layer a key and a value of ``kv_heads x
    head_dim``), the prefill's one-layer activations over the prompts, and fp32 next-token logits."""
    p = arch.params
    shard = gpus if fsdp else 1
    if lora:
        resident = p * 2 + 0.01 * p * 12  # frozen bf16 base; adapters' fp32 masters + Adam
        transient = 0
    else:
        resident = 0 if cpu_offload else 12 * p / shard  # fp32 masters + Adam m and v
        transient = 2 * (2 * arch.layer_params + arch.vocab * arch.h) if fsdp else 2 * p
    reference = (2 * p / shard) if dpo_copy else 0
    head_dim = arch.h // arch.heads
    kv_cache = arch.layers * 2 * arch.kv_heads * head_dim * 2 * sequences * (prompt + completion)
    prefill = sequences * prompt * 2 * (8 * arch.h + 3 * arch.inter)  # one layer's bf16 activations
    logits = 3 * 4 * sequences * arch.vocab  # the last position's fp32 logits, their copy and the probabilities
    return (resident + transient + reference + kv_cache + prefill + logits) / GB


def _estimate(cfg: Any, arch: Arch, checkpointing: bool, rollout: bool = True) -> tuple[float, int, int, str]:
    """(GB per device, devices, tokens per micro-batch, the phase that sets it: step or rollout) of
    the configured run; ``rollout=False``: of its training step alone."""
    entry = OBJECTIVES[cfg.objective.name]  # pairs: a chosen and a rejected row per item; a reference copy or not
    rows = 2 if entry.pairs and source_group(entry.data, cfg.data) != "unpaired" else 1  # unpaired examples: one row
    objective = typed(cfg.objective)
    own = getattr(objective, "micro_batch_tokens", None)  # an objective that says its own shape (GRPO's rollouts)
    tokens = own(cfg.data) if own is not None else cfg.data.batch_size * cfg.data.max_length * rows
    gpus = _devices(cfg.trainer.devices) * cfg.trainer.num_nodes
    fsdp = cfg.strategy.name == "fsdp"
    gb = estimate_gb(
        arch, gpus=gpus, fsdp=fsdp, tokens_per_device=tokens, checkpointing=checkpointing,
        cpu_offload=fsdp and cfg.strategy.cpu_offload, dpo_copy=entry.reference and cfg.objective.reference == "copy"
        and getattr(objective, "needs_reference", True),
        lora=cfg.model.peft.enabled and not cfg.model.quantization.load_in_4bit,
        qlora=cfg.model.quantization.load_in_4bit,
    )
    shape = getattr(objective, "rollout_shape", None)  # an online objective's rollout: the larger of the two
    phase = "step"
    rolled = shape(cfg.data, cfg.trainer) if shape is not None and rollout else None
    if rolled is not None:
        sequences, prompt, completion = rolled
        rollout = rollout_gb(arch, gpus=gpus, fsdp=fsdp, sequences=sequences, prompt=prompt, completion=completion,
                             cpu_offload=fsdp and cfg.strategy.cpu_offload,
                             dpo_copy=cfg.objective.reference == "copy" and objective.needs_reference,
                             lora=cfg.model.peft.enabled)
        gb, phase = (rollout, "rollout") if rollout > gb else (gb, phase)
    return gb, gpus, tokens, phase


def choose_checkpointing(cfg: Any, device_gb: float | None = None) -> tuple[bool, str]:
    """``model.gradient_checkpointing`` as a bool, and why. ``true``/``false`` are taken as set;
    ``auto`` turns activation checkpointing off when the estimate without it fits 90% of a
    ``device_gb`` device (default ``runtime.device_memory_gb``): recomputing every layer's forward
    costs ~30% more compute, worth paying only where memory needs it. Without the model's
    dimensions (a hub id offline) ``auto`` keeps it on."""

    value = checkpointing_setting(cfg.model.gradient_checkpointing)
    if value != "auto":
        return bool(value), "set by model.gradient_checkpointing"
    device_gb = device_gb or cfg.runtime.device_memory_gb
    arch = arch_of(cfg.model)
    if arch is None:
        return True, "auto: on (model dimensions not available offline, so memory cannot be estimated)"
    gb, _, _, _ = _estimate(cfg, arch, checkpointing=False, rollout=False)
    # an online objective's rollout (generate, no gradient) keeps no activations: checkpointing does
    # not change it, so the step alone decides, and a rollout too large is said
    peak, _, _, phase = _estimate(cfg, arch, checkpointing=False)
    rollout = (f"; the rollout (~{peak:.1f} GB) exceeds it either way: activation checkpointing does not lower it"
               if phase == "rollout" and peak > 0.9 * device_gb else "")
    if gb <= 0.9 * device_gb:
        return False, f"auto: off (~{gb:.1f} GB per device without it fits {device_gb:.0f} GB devices{rollout})"
    return True, f"auto: on (~{gb:.1f} GB per device without it exceeds 90% of {device_gb:.0f} GB devices{rollout})"


def check(cfg: Any, device_gb: float | None = None) -> str:
    """One line saying whether the configured run fits a ``device_gb`` GPU (default
    ``runtime.device_memory_gb``); warns if not."""
    device_gb = device_gb or cfg.runtime.device_memory_gb
    arch = arch_of(cfg.model)
    if arch is None:
        return "unknown (model dimensions not available offline)"
    checkpointing, _ = choose_checkpointing(cfg, device_gb)
    gb, gpus, tokens, phase = _estimate(cfg, arch, checkpointing)
    size = f"{arch.params / 1e9:.2f}B" if arch.params >= 1e9 else f"{arch.params / 1e6:.2f}M"
    line = (f"~{gb:.1f} GB per device ({size} params, {gpus} device(s), {tokens} tokens/micro-batch, "
            f"activation checkpointing {'on' if checkpointing else 'off'}"
            f"{', set by the rollout (generate)' if phase == 'rollout' else ''})")
    if gb > 0.9 * device_gb:
        line = f"WARNING: {line} exceeds {device_gb:.0f} GB devices"
        log.warning("memory estimate: %s", line)
    return line


def _devices(devices: Any) -> int:
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, str) and devices.isdigit():
        return int(devices)
    return len(devices) if isinstance(devices, (list, tuple)) else 1


def table() -> str:
    """The README table: 8B full fine-tunes with FSDP, LoRA/QLoRA on one GPU (80 GB)."""
    rows = ["| run | GPUs | act. ckpt | CPU offload | est. GB/GPU | fits 80 GB |", "|---|---|---|---|---|---|"]
    llama = arch_of(_Model("meta-llama/Llama-3.1-8B"))
    sft_tokens, dpo_tokens = 8 * 4200, 2 * 4 * 3000  # paper micro-batches
    for name, tokens, dpo in (("SFT 8B full", sft_tokens, False), ("DPO 8B full (+ref copy)", dpo_tokens, True)):
        for gpus in (4, 8):
            for ckpt, offload in ((False, False), (True, False), (True, True)):
                gb = estimate_gb(llama, gpus=gpus, fsdp=True, tokens_per_device=tokens, checkpointing=ckpt,
                                 cpu_offload=offload, dpo_copy=dpo)
                rows.append(f"| {name} | {gpus} | {'yes' if ckpt else 'no'} | {'yes' if offload else 'no'} "
                            f"| {gb:.0f} | {'yes' if gb <= 72 else 'no'} |")
    for name, kw in (("SFT 8B LoRA r=8", dict(lora=True)), ("SFT 8B QLoRA r=8", dict(qlora=True))):
        for tokens, ckpt in ((sft_tokens, True), (4200, True)):
            gb = estimate_gb(llama, gpus=1, fsdp=False, tokens_per_device=tokens, checkpointing=ckpt, **kw)
            rows.append(f"| {name}, {tokens} tokens/batch | 1 | yes | no | {gb:.0f} | {'yes' if gb <= 72 else 'no'} |")
    return "\n".join(rows)


@dataclass
class _Model:
    path: str
    init: Any = None


def check_memory(cfg: Any) -> str:
    """The estimate for a composed training config (deprecated keys mapped first), logged at
    INFO, or at WARNING when it exceeds ``runtime.device_memory_gb``; returns the line."""
    return log_estimate(upgrade_train_config(cfg))


def log_estimate(cfg: Any) -> str:
    """:func:`check_memory` of a config already checked (``check_train_config`` moved the
    deprecated keys): the training recipe's, which runs the config checks once."""
    line = check(cfg)
    if not line.startswith("WARNING"):
        log.info("memory estimate: %s", line)
    return line


def compose_train_config(overrides: list[str]) -> Any:
    """``conf/train.yaml`` composed with ``overrides``, as ``python train.py`` would (no run)."""
    from hydra import compose, initialize_config_dir


    register()
    conf = Path(__file__).resolve().parents[2] / "conf"
    if not (conf / "train.yaml").is_file():
        raise FileNotFoundError(f"no conf/train.yaml at {conf}: run from a rolemrc checkout")
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose("train", overrides=overrides)


def step_peak(sim: Any) -> int:
    """The simulated training step's peak bytes (forward, backward, AdamW), less an objective's
    rollout phase: what activation checkpointing changes."""
    return int(sim.phases["step"]["peak_bytes"]) if "step" in sim.phases else int(sim.peak_bytes)


def simulated_report(cfg: Any) -> dict[str, Any]:
    """The simulated per-rank peak of the run ``cfg`` (:func:`rolemrc.memory_sim.simulate`) at its
    configured activation checkpointing; for ``auto`` both with and without it, the choice being
    what setup would make (off where the peak without it fits). Keys: ``ranks``, ``peak_gib``,
    ``by_category`` (GiB, the tracker's names), ``gradient_checkpointing`` (``on``/``off`` peaks in
    GiB, null where not simulated), ``fits``, and what the step was."""
    from rolemrc.memory_sim import HEADROOM, simulate

    device_gb = float(cfg.runtime.device_memory_gb)
    limit = HEADROOM * device_gb * GB
    setting = checkpointing_setting(cfg.model.gradient_checkpointing)
    sims = {}
    for on in ((False, True) if setting == "auto" else (bool(setting),)):
        sims[on] = simulate(cfg, checkpointing=on)
    if setting == "auto":  # the step decides: a rollout (generate) keeps no activations to checkpoint
        chosen = False if step_peak(sims[False]) <= limit else True
    else:
        chosen = bool(setting)
    sim = sims[chosen]
    return {
        "ranks": sim.ranks,
        "peak_gib": round(sim.peak_gib, 3),
        "by_category": {k: round(v / GB, 3) for k, v in sim.by_category.items()},
        "gradient_checkpointing": {"on": round(sims[True].peak_gib, 3) if True in sims else None,
                                   "off": round(sims[False].peak_gib, 3) if False in sims else None},
        "fits": sim.peak_bytes <= limit,
        "checkpointing": "on" if chosen else "off",
        "setting": str(setting).lower(),
        "device_memory_gb": device_gb,
        "headroom": HEADROOM,
        "strategy": sim.strategy,
        "note": sim.note,
        "micro_batch": {"rows": sim.rows, "tokens": sim.tokens},
        "tracker": sim.tracker,
        # an objective with a rollout (GRPO): each phase's peak, and which sets the run's
        "phase": sim.phase,
        "phases": {name: {"peak_gib": round(p["peak_bytes"] / GB, 3),
                          "by_category": {k: round(v / GB, 3) for k, v in p["by_category"].items()}}
                   for name, p in sim.phases.items()},
        "rollout": {**sim.rollout, **({"kv_cache_gib": round(sim.rollout["kv_cache_bytes"] / GB, 3)}
                                      if "kv_cache_bytes" in sim.rollout else {})},
    }


def _print_report(r: dict[str, Any]) -> None:
    mb = r["micro_batch"]
    verdict = "fits" if r["fits"] else "does NOT fit"
    print(f"simulated per-rank peak: {r['peak_gib']:.2f} GiB ({r['ranks']} rank(s), strategy={r['strategy']}, "
          f"micro-batch {mb['rows']} rows / {mb['tokens']} tokens, activation checkpointing {r['checkpointing']}); "
          f"{verdict} {r['device_memory_gb']:g} GB devices ({r['headroom']:.0%} usable: "
          f"{r['headroom'] * r['device_memory_gb']:.1f} GiB)")
    if r.get("phases"):
        ro = r["rollout"]
        print(f"  set by the {r['phase']} phase; phases: " + ", ".join(
            f"{name} {p['peak_gib']:.2f} GiB" for name, p in r["phases"].items())
              + f" (rollout: {ro['sequences']} sequences of {ro['prompt_tokens']} + {ro['completion_tokens']} tokens "
              f"at once, KV cache {ro['kv_cache_gib']:.2f} GiB {ro['kv_dtype'].removeprefix('torch.')})")
    for name, gib in sorted(r["by_category"].items(), key=lambda kv: -kv[1]):
        print(f"  {name:16s} {gib:9.3f} GiB")
    if r.get("note"):
        print(f"note: {r['note']}")
    gc = r["gradient_checkpointing"]
    if r["setting"] == "auto":
        print(f"model.gradient_checkpointing=auto: on {gc['on']:.2f} GiB, off {gc['off']:.2f} GiB -> "
              f"{r['checkpointing']}")
    if r.get("phase") == "rollout" and not r["fits"]:
        print("the rollout sets the peak: activation checkpointing does not lower it (generate keeps no "
              "activations); fewer sequences at once (data.batch_size, trainer.accumulate_grad_batches, "
              "objective.num_generations) or shorter ones do")


def _usage() -> str:
    """The command lines of the module docstring, and what the flags do."""
    lines = [line.strip() for line in (__doc__ or "").splitlines() if line.strip().startswith("python -m")]
    return "\n".join(["usage:", *(f"  {line}" for line in lines), "",
                      "Hydra overrides (key=value) pick the training config, as for train.py.",
                      "  --simulate  one optimizer step under fake tensors on fake ranks: the per-rank peak",
                      "  --json      with --simulate: the report also as one JSON object on the last line",
                      "  -h, --help  this message"])


def main(argv: list[str]) -> int:
    """No arguments: the README table. Hydra overrides: that training config's estimate; with
    ``--simulate`` after them, its simulated per-rank peak (``--json``: also as one JSON object on
    the last line)."""
    if not argv:
        print(table())
        return 0
    if "-h" in argv or "--help" in argv:
        print(_usage())
        return 0
    flags = [a for a in argv if a in ("--simulate", "--json")]
    overrides = [a for a in argv if a not in flags]
    if "--json" in flags and "--simulate" not in flags:
        print("error: --json goes with --simulate (python -m rolemrc.memory <overrides> --simulate --json)",
              file=sys.stderr)
        return 1
    unknown = [a for a in overrides if a.startswith("--")]
    if unknown:
        print(f"error: unknown flag {unknown[0]} (expected --simulate, --json after the Hydra overrides)",
              file=sys.stderr)
        return 1
    from hydra.errors import HydraException

    from rolemrc.memory_sim import SimulationUnavailable

    with entry_point():
        try:
            cfg = compose_train_config(overrides)
        except HydraException as err:  # a bad override: Hydra's message, one line, no traceback
            cause = f" ({err.__cause__})" if err.__cause__ is not None else ""
            print(f"error: {err}{cause}".replace("\n", " "), file=sys.stderr)
            return 1
        check_train_config(cfg)  # what setup() refuses before loading anything, refused here too
        if "--simulate" not in flags:
            print(log_estimate(cfg))  # checked just above: the checks run once
            return 0
        try:
            report = simulated_report(cfg)
        except SimulationUnavailable as err:
            print(f"error: cannot simulate this run: {err}", file=sys.stderr)
            return 1
        _print_report(report)
        if "--json" in flags:
            print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
