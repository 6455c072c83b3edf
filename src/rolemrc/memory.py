"""Back-of-the-envelope GPU memory per device for a run, checked before anything loads.

    python -m rolemrc.memory                    # the README table (8B models, 80 GB GPUs)
    python -m rolemrc.memory experiment=rolemrc_llama_sft trainer.devices=8   # one config's estimate

A training run calls :func:`check_memory` in its setup, after the config checks and before any
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

log = logging.getLogger(__name__)
GB = 1024**3

# Architecture facts of the two target models (their config.json), for offline estimates.
KNOWN = {
    "meta-llama/Llama-3.1-8B": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                    tie_word_embeddings=False),
    "Qwen/Qwen2.5-7B": dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944,
                            num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                            tie_word_embeddings=False),
}


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
    return Arch(spec["hidden_size"], spec["num_hidden_layers"], spec.get("intermediate_size", 4 * spec["hidden_size"]),
                spec["num_attention_heads"], spec.get("num_key_value_heads", spec["num_attention_heads"]),
                spec.get("vocab_size", 32000), bool(spec.get("tie_word_embeddings", False)))


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


def _estimate(cfg: Any, arch: Arch, checkpointing: bool) -> tuple[float, int, int]:
    """(GB per device, devices, tokens per micro-batch) of the configured run."""
    dpo = cfg.objective.name == "dpo"
    tokens = cfg.data.batch_size * cfg.data.max_length * (2 if dpo else 1)
    gpus = _devices(cfg.trainer.devices) * cfg.trainer.num_nodes
    fsdp = cfg.strategy.name == "fsdp"
    gb = estimate_gb(
        arch, gpus=gpus, fsdp=fsdp, tokens_per_device=tokens, checkpointing=checkpointing,
        cpu_offload=fsdp and cfg.strategy.cpu_offload, dpo_copy=dpo and cfg.objective.reference == "copy",
        lora=cfg.model.peft.enabled and not cfg.model.quantization.load_in_4bit,
        qlora=cfg.model.quantization.load_in_4bit,
    )
    return gb, gpus, tokens


def choose_checkpointing(cfg: Any, device_gb: float | None = None) -> tuple[bool, str]:
    """``model.gradient_checkpointing`` as a bool, and why. ``true``/``false`` are taken as set;
    ``auto`` turns activation checkpointing off when the estimate without it fits 90% of a
    ``device_gb`` device (default ``runtime.device_memory_gb``): recomputing every layer's forward
    costs ~30% more compute, worth paying only where memory needs it. Without the model's
    dimensions (a hub id offline) ``auto`` keeps it on."""
    from rolemrc.config import checkpointing_setting

    value = checkpointing_setting(cfg.model.gradient_checkpointing)
    if value != "auto":
        return bool(value), "set by model.gradient_checkpointing"
    device_gb = device_gb or cfg.runtime.device_memory_gb
    arch = arch_of(cfg.model)
    if arch is None:
        return True, "auto: on (model dimensions not available offline, so memory cannot be estimated)"
    gb, _, _ = _estimate(cfg, arch, checkpointing=False)
    if gb <= 0.9 * device_gb:
        return False, f"auto: off (~{gb:.1f} GB per device without it fits {device_gb:.0f} GB devices)"
    return True, f"auto: on (~{gb:.1f} GB per device without it exceeds 90% of {device_gb:.0f} GB devices)"


def check(cfg: Any, device_gb: float | None = None) -> str:
    """One line saying whether the configured run fits a ``device_gb`` GPU (default
    ``runtime.device_memory_gb``); warns if not."""
    device_gb = device_gb or cfg.runtime.device_memory_gb
    arch = arch_of(cfg.model)
    if arch is None:
        return "unknown (model dimensions not available offline)"
    checkpointing, _ = choose_checkpointing(cfg, device_gb)
    gb, gpus, tokens = _estimate(cfg, arch, checkpointing)
    size = f"{arch.params / 1e9:.2f}B" if arch.params >= 1e9 else f"{arch.params / 1e6:.2f}M"
    line = (f"~{gb:.1f} GB per device ({size} params, {gpus} device(s), {tokens} tokens/micro-batch, "
            f"activation checkpointing {'on' if checkpointing else 'off'})")
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
    from rolemrc.config import upgrade_train_config

    line = check(upgrade_train_config(cfg))
    if not line.startswith("WARNING"):
        log.info("memory estimate: %s", line)
    return line


def resolve_checkpointing(cfg: Any) -> bool:
    """Replace ``model.gradient_checkpointing: auto`` in ``cfg`` by the choice of
    :func:`choose_checkpointing` (logged), so everything built after sees a bool."""
    from omegaconf import open_dict

    choice, why = choose_checkpointing(cfg)
    log.info("activation checkpointing: %s, %s", "on" if choice else "off", why)
    with open_dict(cfg):
        cfg.model.gradient_checkpointing = choice
    return choice


def compose_train_config(overrides: list[str]) -> Any:
    """``conf/train.yaml`` composed with ``overrides``, as ``python train.py`` would (no run)."""
    from hydra import compose, initialize_config_dir

    from rolemrc.config import register

    register()
    conf = Path(__file__).resolve().parents[2] / "conf"
    if not (conf / "train.yaml").is_file():
        raise FileNotFoundError(f"no conf/train.yaml at {conf}: run from a rolemrc checkout")
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose("train", overrides=overrides)


def main(argv: list[str]) -> int:
    """No arguments: the README table. Hydra overrides: that training config's estimate."""
    if not argv:
        print(table())
        return 0
    from hydra.errors import HydraException

    from rolemrc.entry import entry_point

    with entry_point():
        try:
            cfg = compose_train_config(argv)
        except HydraException as err:  # a bad override: Hydra's message, one line, no traceback
            cause = f" ({err.__cause__})" if err.__cause__ is not None else ""
            print(f"error: {err}{cause}".replace("\n", " "), file=sys.stderr)
            return 1
        from rolemrc.config import check_train_config

        check_train_config(cfg)  # what setup() refuses before loading anything, refused here too
        print(check_memory(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
