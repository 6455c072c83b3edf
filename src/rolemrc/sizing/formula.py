"""The formula: back-of-the-envelope GPU memory per device for a run, checked before anything loads.

``python -m rolemrc.memory`` prints the table of docs/memory.md, ``python -m rolemrc.memory <train overrides>``
one config's estimate (:mod:`rolemrc.memory`, the command line). A training run calls
:func:`log_estimate` in its setup, after the config checks and before any weight loads: it logs
the estimate, and warns when it exceeds ``runtime.device_memory_gb``. Where the run cannot be
simulated (:mod:`rolemrc.sizing.simulate`), :func:`choose_checkpointing` decides
``model.gradient_checkpointing=auto`` (:mod:`rolemrc.sizing.decide`).

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
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rolemrc import ASSETS
from rolemrc.config import TrainStep, checkpointing_setting, objective_settings, source_group
from rolemrc.models.family import memory_shape

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
    if not spec or not all(isinstance(spec.get(k), int) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads")):
        return None  # no sizes to read (a custom architecture's config): no estimate
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


def _estimate(step: TrainStep, arch: Arch, checkpointing: bool, rollout: bool = True) -> tuple[float, int, int, str]:
    """(GB per device, devices, tokens per micro-batch, the phase that sets it: step or rollout) of
    the configured run; ``rollout=False``: of its training step alone."""
    entry = step.entry  # pairs: a chosen and a rejected row per item; a reference copy or not
    rows = 2 if entry.pairs and source_group(entry.data, step.data) != "unpaired" else 1  # unpaired examples: one row
    objective = objective_settings(step.objective)
    env = step.env  # a multi-turn environment: GRPO's rollouts are whole conversations
    own = objective.micro_batch_tokens(step.data, env)  # an objective that says its own shape (GRPO's rollouts)
    tokens = own if own is not None else step.data.batch_size * step.data.max_length * rows
    gpus = _devices(step.trainer.devices) * step.trainer.num_nodes
    fsdp = step.strategy.name == "fsdp"
    gb = estimate_gb(
        arch, gpus=gpus, fsdp=fsdp, tokens_per_device=tokens, checkpointing=checkpointing,
        cpu_offload=fsdp and step.strategy.cpu_offload, dpo_copy=entry.reference and step.objective.reference == "copy"
        and objective.needs_reference,
        lora=step.model.peft.enabled and not step.model.quantization.load_in_4bit,
        qlora=step.model.quantization.load_in_4bit,
    )
    phase = "step"  # an online objective's rollout: the larger of the two
    rolled = objective.rollout_shape(step.data, step.trainer, env) if rollout else None
    if rolled is not None:
        sequences, prompt, completion = rolled
        rollout = rollout_gb(arch, gpus=gpus, fsdp=fsdp, sequences=sequences, prompt=prompt, completion=completion,
                             cpu_offload=fsdp and step.strategy.cpu_offload,
                             dpo_copy=step.objective.reference == "copy" and objective.needs_reference,
                             lora=step.model.peft.enabled)
        gb, phase = (rollout, "rollout") if rollout > gb else (gb, phase)
    return gb, gpus, tokens, phase


def choose_checkpointing(step: TrainStep, device_gb: float | None = None) -> tuple[bool, str]:
    """``model.gradient_checkpointing`` as a bool, and why. ``true``/``false`` are taken as set;
    ``auto`` turns activation checkpointing off when the estimate without it fits 90% of a
    ``device_gb`` device (default ``runtime.device_memory_gb``): recomputing every layer's forward
    costs ~30% more compute, worth paying only where memory needs it. Without the model's
    dimensions (a hub id offline) ``auto`` keeps it on."""

    value = checkpointing_setting(step.model.gradient_checkpointing)
    if value != "auto":
        return bool(value), "set by model.gradient_checkpointing"
    device_gb = device_gb or step.runtime.device_memory_gb
    arch = arch_of(step.model)
    if arch is None:
        return True, "auto: on (model dimensions not available offline, so memory cannot be estimated)"
    gb, _, _, _ = _estimate(step, arch, checkpointing=False, rollout=False)
    # an online objective's rollout (generate, no gradient) keeps no activations: checkpointing does
    # not change it, so the step alone decides, and a rollout too large is said
    peak, _, _, phase = _estimate(step, arch, checkpointing=False)
    rollout = (f"; the rollout (~{peak:.1f} GB) exceeds it either way: activation checkpointing does not lower it"
               if phase == "rollout" and peak > 0.9 * device_gb else "")
    if gb <= 0.9 * device_gb:
        return False, f"auto: off (~{gb:.1f} GB per device without it fits {device_gb:.0f} GB devices{rollout})"
    return True, f"auto: on (~{gb:.1f} GB per device without it exceeds 90% of {device_gb:.0f} GB devices{rollout})"


def check(step: TrainStep, device_gb: float | None = None) -> str:
    """One line saying whether the configured run fits a ``device_gb`` GPU (default
    ``runtime.device_memory_gb``); warns if not."""
    device_gb = device_gb or step.runtime.device_memory_gb
    arch = arch_of(step.model)
    if arch is None:
        return "unknown (model dimensions not available offline)"
    checkpointing, _ = choose_checkpointing(step, device_gb)
    gb, gpus, tokens, phase = _estimate(step, arch, checkpointing)
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
    """The table of docs/memory.md: 8B full fine-tunes with FSDP, LoRA/QLoRA on one GPU (80 GB)."""
    rows = ["| run | GPUs | act. ckpt | CPU offload | est. GB/GPU | fits 80 GB |", "|---|---|---|---|---|---|"]
    llama = arch_of(SimpleNamespace(path="meta-llama/Llama-3.1-8B"))
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


def log_estimate(step: TrainStep) -> str:
    """The estimate of a checked run's step (``check_train_config`` moved the deprecated keys), logged
    at INFO, or at WARNING when it exceeds ``runtime.device_memory_gb``; returns the line."""
    line = check(step)
    if not line.startswith("WARNING"):
        log.info("memory estimate: %s", line)
    return line
